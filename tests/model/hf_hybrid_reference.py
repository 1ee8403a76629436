"""The reference side of test_hf_hybrid.py: run in a subprocess with a current transformers.

    python tests/model/hf_hybrid_reference.py OUT CASES_JSON

For each case {"name", "kind": "qwen3_5_text" | "qwen3_next" | "granitemoehybrid" | "bamba", "config":
{its config's kwargs}, "batch", "length", "prompt", "chunk", "seed"}: build a random
`Qwen3_5ForCausalLM`, `Qwen3NextForCausalLM`, `GraniteMoeHybridForCausalLM` or
`BambaForCausalLM`, perturb every
parameter so that norms, decays, gates and biases all matter, `save_pretrained` it to
OUT/name with a small word-level tokenizer.json, and write OUT/name/reference.safetensors,
computed in float64 from the saved float32 weights (but inside transformers' Gated DeltaNet
kernels, which compute in float32 whatever they are given), so that the reference's own
rounding is not what the tests measure:
    input_ids [B, T]
    whole     [B, T, V]  logits of the whole sequence in one call, no cache
    cached    [B, T, V]  logits of its first `prompt` tokens in one call with a cache, then of
                         chunks of `chunk` tokens through the cache, the last `chunk` tokens
                         one at a time (generation's path)

This file imports transformers, so it never runs in the main environment.
"""

from __future__ import annotations

import torch
from hf_cases import Special, build, main  # (this folder: the script's own, first on its path)
from hf_ssm_reference import save_tokenizer
from safetensors.torch import save_file
from transformers import (
    BambaConfig,
    BambaForCausalLM,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5TextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

KINDS = {
    "qwen3_5_text": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
    "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),
    "granitemoehybrid": (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM),
    "bamba": (BambaConfig, BambaForCausalLM),
}

# matrices of outputs with 0.6 of unit variance (hf_cases' default is 1): deep enough into
# fp32's range that the four layers' rounding stays far below the tests' 1e-4
MATRICES: Special = [
    (
        lambda name: not name.endswith(("bias", "norm.weight", "A_log", "D")),
        lambda p, noise: 0.6 * noise / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.2 * noise,
    )
]
DECAYS: Special = [
    # A = -exp(A_log) stays a decay, Delta's bias a bias: perturbed around their init
    (lambda name: name.endswith("A_log"), lambda p, noise: p + 0.3 * noise),
    (lambda name: name.endswith("dt_bias"), lambda p, noise: p + 0.5 * noise),
]
# Qwen's norms are zero-centred (weight 1 + w) but for the gated one in each DeltaNet layer.
# Its decays are drawn slow (A = exp(A_log) about 0.4 rather than HF's 0.01..16): a head that
# forgets everything at each token leaves an output of almost nothing, which the gated norm
# after it scales up a thousandfold, rounding and all, in transformers as here; slow heads
# make the state matter more, too
QWEN: Special = [
    (lambda name: name.endswith("A_log"), lambda p, noise: -1.0 + 0.5 * noise),
    *DECAYS,
    (lambda name: name.endswith("linear_attn.norm.weight"), lambda p, noise: 1.0 + 0.2 * noise),
    *MATRICES,
]
# Granite's are plain: around 1
GRANITE: Special = [
    *DECAYS,
    (lambda name: name.endswith("norm.weight"), lambda p, noise: 1.0 + 0.2 * noise),
    *MATRICES,
]


def logits_through_cache(model, ids: torch.Tensor, prompt: int, chunk: int) -> torch.Tensor:
    """The prompt in one call, then chunks of `chunk`, the last `chunk` tokens one by one."""
    T = ids.shape[1]
    bounds = [0, prompt, *range(prompt + chunk, T - chunk, chunk), T - chunk, *range(T - chunk + 1, T + 1)]
    bounds = sorted(set(bounds))
    res = model(input_ids=ids[:, : bounds[1]], use_cache=True)
    cache, out = res.cache, [res.logits]
    for a, b in zip(bounds[1:], bounds[2:], strict=False):
        res = model(input_ids=ids[:, a:b], cache=cache, use_cache=True)
        cache = res.cache
        out.append(res.logits)
    return torch.cat(out, 1)


def random_model(case: dict, eos_token_id: int = 0):
    """The case's model (its kind, its config; BOS 1), perturbed its kind's way, in eval mode;
    and the generator to draw its inputs from."""
    config_class, model_class = KINDS[case["kind"]]
    cfg = config_class(**case["config"], bos_token_id=1, eos_token_id=eos_token_id, pad_token_id=0)
    cfg._attn_implementation = "eager"
    return build(case, lambda: model_class(cfg), QWEN if case["kind"].startswith("qwen") else GRANITE)


def run_case(out, case: dict) -> None:
    model, gen = random_model(case)
    cfg = model.config
    target = out / case["name"]
    model.save_pretrained(target)
    save_tokenizer(target, cfg.vocab_size)

    B, T = case["batch"], case["length"]
    ids = torch.randint(2, cfg.vocab_size, (B, T), generator=gen)
    # the saved fp32 weights, run in fp64 (but in the DeltaNet kernels, which cast to fp32)
    model = model.double()
    with torch.no_grad():
        whole = model(input_ids=ids, use_cache=False).logits
        cached = logits_through_cache(model, ids, case["prompt"], case["chunk"])
    save_file(
        {
            "input_ids": ids.contiguous(),
            "whole": whole.float().contiguous(),
            "cached": cached.float().contiguous(),
        },
        str(target / "reference.safetensors"),
    )


if __name__ == "__main__":
    main(run_case)
