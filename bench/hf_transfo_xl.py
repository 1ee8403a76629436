"""The reference side of bench/streams_hf.py's HF row: HF TransfoXL 4.37.2's decode step.

    python bench/hf_transfo_xl.py OUT ROUNDS

Run in a subprocess with the isolated environment `.venv-ref/` first on its path
(tests/model/reference_env.py's LEGACY); torch is the main environment's. On its first
run it builds a random `TransfoXLLMHeadModel`, 6 layers × 512, mem 512, byte vocabulary,
and `save_pretrained`s it to OUT/hf (with a vocab.txt, so recur loads the same weights
through model/hf.py); later runs load it from there. It fills the memory with 512 tokens,
then times HF's decode step (one token with the memory carried, the argmax picked as the
next token) at batch 1 and 16, 1 torch thread, `ROUNDS` rounds of 10 steps, the best
round's median. It writes OUT/hf/reference.safetensors (the fill, the step's token and
HF's log-probs after it) for recur to check the weights are the same, and prints JSON:
{"step_s": {"1": s, "16": s}}.

This file imports transformers, so it never runs in the main environment (numpy 2).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import TransfoXLConfig, TransfoXLLMHeadModel

CONFIG = dict(
    vocab_size=256, cutoffs=[], div_val=1, d_model=512, d_embed=512, n_head=8, d_head=64, d_inner=2048,
    n_layer=6, mem_len=512, tgt_len=128, clamp_len=1000, same_length=False, dropout=0.0, untie_r=True,
)  # fmt: skip
FILL, BATCHES, STEPS = 512, (1, 16), 10


def model_at(target: Path) -> TransfoXLLMHeadModel:
    if (target / "config.json").is_file():
        return TransfoXLLMHeadModel.from_pretrained(target).eval()
    torch.manual_seed(0)
    model = TransfoXLLMHeadModel(TransfoXLConfig(**CONFIG)).eval()
    model.save_pretrained(target, safe_serialization=True)
    symbols = ["<eos>", "<unk>"] + [f"w{i}" for i in range(2, CONFIG["vocab_size"])]
    (target / "vocab.txt").write_text("".join(s + "\n" for s in symbols))
    return model


@torch.no_grad()
def main() -> None:
    out, rounds = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    target = out / "hf"
    model = model_at(target)
    gen = torch.Generator().manual_seed(0)
    fill = torch.randint(0, CONFIG["vocab_size"], (1, FILL), generator=gen)
    empty = [torch.empty(0, 1, CONFIG["d_model"]) for _ in range(CONFIG["n_layer"])]  # (HF: mem_len zeros)
    mems = model(input_ids=fill, mems=empty).mems  # FILL rows per layer: the memory is full
    nxt = torch.tensor([[7]])
    first = model(input_ids=nxt, mems=mems).prediction_scores[0, -1]
    save_file(
        {"fill": fill, "next": nxt, "logprobs": first.contiguous()}, str(target / "reference.safetensors")
    )
    best = {B: float("inf") for B in BATCHES}
    batched = {B: [m.expand(-1, B, -1).contiguous() for m in mems] for B in BATCHES}  # (M, B, d)
    for _ in range(rounds):
        for B in BATCHES:
            ids, m = torch.zeros(B, 1, dtype=torch.long), batched[B]
            times = []
            for _ in range(STEPS + 1):  # the first is a warm-up
                t0 = time.perf_counter()
                res = model(input_ids=ids, mems=m)
                ids, m = res.prediction_scores[:, -1].argmax(-1)[:, None], res.mems
                times.append(time.perf_counter() - t0)
            best[B] = min(best[B], statistics.median(times[1:]))
    print(json.dumps({"step_s": {str(B): t for B, t in best.items()}}))


if __name__ == "__main__":
    main()
