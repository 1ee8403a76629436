"""The reference side of test_hf_parity.py: run in a subprocess with transformers 4.37.2.

    python tests/model/hf_reference.py OUT CASES_JSON

For each case {"name", "config": {TransfoXLConfig kwargs}, "tgt_len", "segments",
"batch", "safe_serialization", "seed"}: build a random `TransfoXLLMHeadModel`, perturb
every parameter so biases, LayerNorms and projections all matter, `save_pretrained` it to
OUT/name with a plain-text vocab.txt, run `segments` consecutive segments of `tgt_len`
tokens with the memory carried (starting EMPTY: HF would otherwise start from zeros), and
write OUT/name/reference.safetensors = {"input_ids" [B, S*T], "logprobs" [B, S*T, V]}.

This file imports transformers, so it never runs in the main environment (numpy 2).
"""

from __future__ import annotations

from pathlib import Path

import torch
from hf_cases import Special, build, main  # (this folder: the script's own, first on its path)
from safetensors.torch import save_file
from transformers import TransfoXLConfig, TransfoXLLMHeadModel

SPECIAL: Special = [
    (lambda name: "layer_norm.weight" in name, lambda p, noise: 1.0 + 0.2 * noise),
    (lambda name: name.endswith(("r_w_bias", "r_r_bias")), lambda p, noise: 0.5 * noise),
]


def run_case(out: Path, case: dict) -> None:
    cfg = TransfoXLConfig(**case["config"])
    model, gen = build(case, lambda: TransfoXLLMHeadModel(cfg), SPECIAL)
    target = out / case["name"]
    model.save_pretrained(target, safe_serialization=case["safe_serialization"])
    symbols = ["<eos>", "<unk>"] + [f"w{i}" for i in range(2, cfg.vocab_size)]
    (target / "vocab.txt").write_text("".join(s + "\n" for s in symbols))

    B, T, S = case["batch"], case["tgt_len"], case["segments"]
    ids = torch.randint(0, cfg.vocab_size, (B, S * T), generator=gen)
    mems = [torch.empty(0, B, cfg.d_model) for _ in range(cfg.n_layer)]
    logprobs = []
    with torch.no_grad():
        for s in range(S):
            res = model(input_ids=ids[:, s * T : (s + 1) * T], mems=mems)
            logprobs.append(res.prediction_scores)
            mems = res.mems
    save_file(
        {"input_ids": ids.contiguous(), "logprobs": torch.cat(logprobs, 1).contiguous()},
        str(target / "reference.safetensors"),
    )


if __name__ == "__main__":
    main(run_case)
