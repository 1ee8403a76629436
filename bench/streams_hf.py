"""Section 12 against HF (bench/streams.py): HF TransfoXL 4.37.2's decode step (bench/hf_transfo_xl.py,
run in `.venv-ref` as a subprocess) ÷ recur's on the same weights, at batch 1 and 16, with recur's
log-probs after the step checked against HF's.

Measures only: it writes no page (bench/streams.py renders what `hf_level` returns).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from harness import ROOT
from roofline import work
from safetensors.torch import load_file
from streams_model import cache_mb, step_times_on

import model

REFERENCE = Path(__file__).with_name("hf_transfo_xl.py")


def hf_steps(out: Path, rounds: int) -> dict[int, float]:
    """HF's decode step (seconds) at batch 1 and 16, from the reference subprocess."""
    sys.path.insert(0, str(ROOT))  # tests/ is not installed: its reference environments
    from tests.model.reference_env import LEGACY

    text = LEGACY.run(REFERENCE, out, rounds, home=out / "hf-home", timeout=1800)
    return {int(B): t for B, t in json.loads(text.splitlines()[-1])["step_s"].items()}


@torch.no_grad()
def hf_level(rounds: int) -> dict:
    """HF TransfoXL's decode step ÷ recur's, on the same weights (bench/hf_transfo_xl.py)."""
    torch.set_num_threads(1)
    out = Path(tempfile.mkdtemp(prefix="recur-hf-"))
    hf = hf_steps(out, rounds)
    lm = model.load(out / "hf", device="cpu")
    ref = load_file(str(out / "hf" / "reference.safetensors"))
    state = lm.consume(torch.cat([ref["fill"][0], ref["next"][0]]), lm.new_state(1))[1]
    diff = float((F.log_softmax(lm.next_logits(state).float(), -1)[0] - ref["logprobs"]).abs().max())
    ours = {B: step_times_on(lm, lm.stack_states([state] * B), rounds) for B in hf}
    batch = lm.stack_states([state] * max(hf))
    w = work(lm, batch)
    need = {
        "rows": max(hf),
        "mb": round(w.bytes / 1e6, 2),
        "mflop": round(w.flops / 1e6, 1),
        "kv_mb": cache_mb(batch),
    }
    again = hf_steps(out, rounds)  # HF before and after recur: the best of both
    hf = {B: min(t, again[B]) for B, t in hf.items()}
    row = {"hf_ms": {B: round(t * 1e3, 3) for B, t in hf.items()},
           "recur_ms": {B: round(t * 1e3, 3) for B, t in ours.items()}, "max_abs_logprob_diff": diff, "work": need}  # fmt: skip
    row.update({f"hf_{B}": round(hf[B] / ours[B], 2) for B in hf})
    print(row, flush=True)
    return row
