"""The reference side of test_hf_ssm.py: run in a subprocess with a current transformers.

    python tests/model/hf_ssm_reference.py OUT CASES_JSON

For each case {"name", "kind": "mamba" | "mamba2", "config": {MambaConfig / Mamba2Config
kwargs}, "batch", "length", "prompt", "seed"}: build a random `MambaForCausalLM` or
`Mamba2ForCausalLM`, perturb every parameter so biases, norms and the SSM parameters all
matter, `save_pretrained` it to OUT/name with a small word-level tokenizer.json, and write
OUT/name/reference.safetensors:
    input_ids [B, T]
    whole     [B, T, V]  logits of the whole sequence in one call, no cache
    cached    [B, T, V]  logits of its first `prompt` tokens in one call with a cache, then
                         of every later token fed alone with the cache (generation's path)
    generated [B, 8]     greedy generation (`generate`, the cache) after the first `prompt` tokens

This file imports transformers, so it never runs in the main environment.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hf_cases import Special, build, main  # (this folder: the script's own, first on its path)
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

KINDS = {"mamba": (MambaConfig, MambaForCausalLM), "mamba2": (Mamba2Config, Mamba2ForCausalLM)}


SPECIAL: Special = [
    # A = -exp(A_log) stays a decay: perturb its log
    (lambda name: name.endswith("A_log"), lambda p, noise: p + 0.3 * noise),
    (lambda name: name.endswith(("norm.weight", "norm_f.weight")), lambda p, noise: 1.0 + 0.2 * noise),
    (lambda name: name.endswith(("dt_proj.bias", "dt_bias")), lambda p, noise: p + 0.5 * noise),
]


def save_tokenizer(target: Path, vocab_size: int) -> None:
    """A word-level tokenizer over vocab_size symbols: <eos>, <bos>, then w2, w3, ..."""
    vocab = {"<eos>": 0, "<bos>": 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(target / "tokenizer.json"))


def run_case(out: Path, case: dict) -> None:
    config_class, model_class = KINDS[case["kind"]]
    cfg = config_class(**case["config"], bos_token_id=1, eos_token_id=0, pad_token_id=0)
    model, gen = build(case, lambda: model_class(cfg), SPECIAL)
    target = out / case["name"]
    model.save_pretrained(target)
    save_tokenizer(target, cfg.vocab_size)

    B, T, P = case["batch"], case["length"], case["prompt"]
    ids = torch.randint(2, cfg.vocab_size, (B, T), generator=gen)
    with torch.no_grad():
        whole = model(input_ids=ids, use_cache=False).logits
        res = model(input_ids=ids[:, :P], use_cache=True)
        cache, cached = res.cache, [res.logits]
        for t in range(P, T):
            res = model(input_ids=ids[:, t : t + 1], cache=cache, use_cache=True)
            cache = res.cache
            cached.append(res.logits)
        generated = model.generate(
            ids[:, :P],
            attention_mask=torch.ones_like(ids[:, :P]),
            max_new_tokens=8,
            do_sample=False,
            use_cache=True,
        )[:, P:]
    save_file(
        {
            "input_ids": ids.contiguous(),
            "whole": whole.float().contiguous(),
            "cached": torch.cat(cached, 1).float().contiguous(),
            "generated": generated.contiguous(),
        },
        str(target / "reference.safetensors"),
    )


if __name__ == "__main__":
    main(run_case)
