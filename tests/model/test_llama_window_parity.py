"""LLaMA past its window, its sinks engaged (issue 38): recur's log-probs against transformers
computing the same attention pattern, along both paths a token takes through the server.

- `forward`: a prompt consumed in chunks (`LanguageModel.consume`, and uneven chunks of
  `forward` itself, one longer than the window);
- the decode step the engine runs per token (`app.engine.compiler.DecodeStep`, eager:
  `forward` with `IN_PLACE` on the batch's states stacked as the runner stacks them, in
  arenas the step grows in place), teacher-forced, several rows of different histories
  in one batch, as the runner's `decode` calls it: `next_logits` of the batch, then the
  step with each row's next token.

The reference (`streaming_logits`, tests/model/llama_reference.py) is transformers' own
LlamaForCausalLM reading the same GGUF file in its isolated environment: every number in
it is transformers' (embeddings, RoPE, grouped-query attention, norms, MLP), and the script
only chooses which cached keys each query meets and at which positions transformers
rotates them, from the semantics model/llama.py documents (StreamingLLM's: the sinks seen
as if the query stood right after the cache [sinks; window]). transformers has no sinks
cache for LLaMA (its SinkCache went with 4.53; 4.37's cannot read GGUF), and an attention
mask over the whole sequence cannot give the sinks their cache-relative positions, so the
reference keeps the cache itself: the window as transformers cached it, the sinks
recomputed by transformers at shifted positions for each query.

Here a tiny random GGUF file (tests/model/llama_files.py) with 4 sinks and a window of 32,
over 120 tokens: 83 positions past the first S + W + 1. fp32 throughout; the log-probs
must agree within 1e-4 (the fp32 rounding of two implementations; recur's RoPE angles are
float64, transformers' float32, which at positions ~100 is about 1e-5 rad). The shipped
SmolLM2 with its own 4 + 1,024 over 1,300 tokens: tests/model/test_smollm2.py (slow).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import model
from app.engine.compiler import DecodeStep
from model.corpus import load_split

from .llama_files import random_weights, write_gguf
from .reference_env import CURRENT

REF_SCRIPT = Path(__file__).with_name("llama_reference.py")
SINKS, WINDOW = 4, 32
N_TOKENS = 120
TGT_LEN = 16  # the prompt's chunks (`consume`), so they cross the window's end
TOL = 1e-3
# where each decode row's teacher-forced steps start: within the first S + W + 1 positions
# and past them, so the batch's rows have windows and sinks of different fills
PREFIXES = (1, 20, 45)
STEPS = N_TOKENS - max(PREFIXES)

pytestmark = pytest.mark.usefixtures("one_thread")


def texts(n: int, length: int) -> list[list[int]]:
    """`n` held-out passages as text, for the tokenizer to make `length` tokens of each."""
    play = load_split("shakespeare", "test")[1][1]
    return [play[10_000 * (i + 1) : 10_000 * (i + 1) + 8 * length] for i in range(n)]


def reference(tmp: Path, path: Path, cases: dict[str, dict], timeout: float = 600) -> dict[str, torch.Tensor]:
    """name -> transformers' log-probs for each case ({"ids", ...}) over the GGUF file `path`."""
    spec = [
        {"name": name, "kind": "gguf", "dir": str(path.parent), "file": path.name, **c}
        for name, c in cases.items()
    ]
    (tmp / "cases.json").write_text(json.dumps(spec))
    CURRENT.run(REF_SCRIPT, tmp, tmp / "cases.json", home=tmp / "hf-home", timeout=timeout)
    return {name: load_file(str(tmp / f"{name}.safetensors"))["logprobs"] for name in cases}


def chunked_logprobs(lm: model.LanguageModel, ids: list[int], chunks: tuple[int, ...]) -> torch.Tensor:
    """log_softmax of `forward`'s logits over `ids` (N, V), fed in `chunks` then the rest."""
    state, parts, i = lm.new_state(1), [], 0
    with torch.no_grad():
        for n in (*chunks, len(ids)):
            if i < len(ids):
                logits, state = lm(torch.tensor([ids[i : i + n]]), state)
                parts.append(logits[0])
                i += n
    return torch.log_softmax(torch.cat(parts).float(), -1)


def decode_step_logprobs(
    lm: model.LanguageModel, rows: list[list[int]], states: list[model.State], steps: int
) -> torch.Tensor:
    """Each row's log-probs (B, steps) of its next `steps` tokens through the engine's decode
    step: row b's `states[b]` (each row's own, having consumed a prefix of rows[b]) stacked
    into one batch (`stack_states`, as the runner batches them) and stepped one token at a
    time, teacher-forced, as `Runner.decode` steps a batch."""
    step = DecodeStep(lm, compile=False)
    starts = [int(st.n_tokens[0]) for st in states]
    batch = lm.stack_states(states)
    out = []
    for t in range(steps):
        ids = torch.tensor([ids[k + t] for ids, k in zip(rows, starts, strict=True)])
        lp = torch.log_softmax(lm.next_logits(batch).float(), -1)  # (B, V), as `_sample` reads it
        out.append(lp.gather(1, ids[:, None])[:, 0])
        _, batch = step(ids[:, None], batch)
    assert batch.arenas, "the step grew the batch in place, as the engine's does"
    return torch.stack(out, 1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[model.LanguageModel, list[list[int]], dict]:
    """The tiny GGUF model with 4 sinks and a window of 32, three held-out rows of
    N_TOKENS tokens, and the reference's log-probs: each row as a stream, and the first
    row with full attention (to show that the window changes them)."""
    root = tmp_path_factory.mktemp("llama-window")
    path = write_gguf(root / "tiny.gguf", random_weights(seed=5), "F32")
    lm = model.load(
        path, device="cpu", precision="fp32", options={"sinks": SINKS, "window": WINDOW, "tgt_len": TGT_LEN}
    )
    rows = [lm.tokenizer.encode(t)[:N_TOKENS] for t in texts(len(PREFIXES), N_TOKENS)]
    assert all(len(r) == N_TOKENS for r in rows)
    stream = {"streaming": {"sinks": SINKS, "window": WINDOW}}
    cases = {f"row{i}": {"ids": ids, **stream} for i, ids in enumerate(rows)}
    cases["row0-full"] = {"ids": rows[0]}
    (root / "out").mkdir()
    return lm, rows, reference(root / "out", path, cases)


def targets(ref: torch.Tensor, ids: list[int], start: int, n: int) -> torch.Tensor:
    """The log-probs (n,) that `ref` (N, V) gives ids[start : start + n], each after those before it."""
    return ref[start - 1 : start - 1 + n].gather(1, torch.tensor(ids[start : start + n])[:, None])[:, 0]


def test_forward_past_the_window_equals_transformers(tiny):
    lm, rows, ref = tiny
    assert (lm.config.sinks, lm.config.window) == (SINKS, WINDOW) and N_TOKENS > SINKS + WINDOW + 1
    for i, ids in enumerate(rows):
        # one chunk longer than the window, others crossing its end and the sinks'
        got = chunked_logprobs(lm, ids, (1, 2, 7, 50, 13))
        assert got.shape == ref[f"row{i}"].shape
        assert (got - ref[f"row{i}"]).abs().max().item() <= TOL
        # and a prompt as the server consumes it, in chunks of tgt_len
        lps, _ = lm.consume(ids, lm.new_state(1))
        assert (lps[0, 1:] - targets(ref[f"row{i}"], ids, 1, N_TOKENS - 1)).abs().max().item() <= TOL


def test_the_window_changes_the_logprobs(tiny):
    """Past S + W + 1 positions the stream's log-probs are not full attention's: the parity
    above is a parity of the window and the sinks, not of a model that sees everything."""
    lm, rows, ref = tiny
    head = SINKS + WINDOW + 1
    assert (ref["row0"][:head] - ref["row0-full"][:head]).abs().max().item() <= TOL
    assert (ref["row0"][head:] - ref["row0-full"][head:]).abs().max().item() > 100 * TOL


def test_the_engines_decode_step_past_the_window_equals_transformers(tiny):
    lm, rows, ref = tiny
    states = [lm.consume(ids[:k], lm.new_state(1))[1] for ids, k in zip(rows, PREFIXES, strict=True)]
    got = decode_step_logprobs(lm, rows, states, STEPS)
    for b, (ids, k) in enumerate(zip(rows, PREFIXES, strict=True)):
        assert (got[b] - targets(ref[f"row{b}"], ids, k, STEPS)).abs().max().item() <= TOL, b
