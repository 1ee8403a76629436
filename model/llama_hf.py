"""Hugging Face checkpoints of LLaMA-architecture models, `LlamaForCausalLM` and
`MistralForCausalLM`, read into the `llama` family (`model/llama.py`). A directory holds

    config.json              model_type "llama" or "mistral" (Mistral's `sliding_window`)
    model.safetensors        or its shards (*.index.json); pytorch_model.bin as plain tensors
    tokenizer.json           the `tokenizers` library's own description, used as it is
    tokenizer_config.json    the chat template (`model/checkpoint.py` reads it), BOS and EOS
    generation_config.json   the EOS ids that end a turn (its stop strings, if it has some)

HF stores q and k in the rotate-half layout this family uses, so the weights are a rename
and two concatenations (q, k, v into one matrix; gate and up into another). A model trained
with a sliding window (Mistral: each position sees itself and the sliding_window - 1
before it) keeps exactly that window and no sinks; any other gets the family's default
sinks and window (`model.llama.serving_span`).

This module builds on the HF files' reading (`model/hf_files.py`) and the native format, and must never
import `model/checkpoint.py`, whose registry picks this reader (`READER`) for these
directories.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from .hf_files import json_file, read_weights, stop_strings, tokenizer
from .llama import Llama, layer_weights, serving_span
from .native import build
from .reader import Reader

MODEL_TYPES = ("llama", "mistral")
# the parts of a layer (`model.llama.LAYER`) by their HF names
HF_PARTS = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
    "norm1": "input_layernorm",
    "norm2": "post_attention_layernorm",
}


def claims(path: Path) -> bool:
    """Whether `path` is a HF directory of a model type this reader reads."""
    return json_file(path / "config.json").get("model_type") in MODEL_TYPES


def native_config(hf: dict[str, Any]) -> dict[str, Any]:
    """A HF LlamaConfig / MistralConfig dict -> the `LlamaConfig` fields."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(
            f"RoPE scaling {rope.get('rope_type', rope.get('type'))!r} is not supported (plain RoPE only)"
        )
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError("attention or MLP biases are not supported (LLaMA has none)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"activation {hf['hidden_act']!r} is not supported (SwiGLU with silu only)")
    n_head, d_model = hf["num_attention_heads"], hf["hidden_size"]
    trained = hf.get("max_position_embeddings", 0)
    cfg = {
        "vocab_size": hf["vocab_size"],
        "n_layer": hf["num_hidden_layers"],
        "d_model": d_model,
        "n_head": n_head,
        "n_kv_head": hf.get("num_key_value_heads") or n_head,
        "head_dim": hf.get("head_dim") or d_model // n_head,
        "d_ff": hf["intermediate_size"],
        "rope_base": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_weights": bool(hf.get("tie_word_embeddings", False)),
        "trained_context": trained,
    }
    sliding = hf.get("sliding_window") if hf.get("model_type") == "mistral" else None
    return {**cfg, **serving_span(trained, sliding)}


def state_dict(source: dict[str, torch.Tensor], cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The family's weights from HF's names (q, k, v and gate, up joined)."""
    src = {k.removeprefix("model."): v.to(torch.float32) for k, v in source.items()}
    out = {"tok_emb.weight": src.pop("embed_tokens.weight"), "norm_out.weight": src.pop("norm.weight")}
    head = src.pop("lm_head.weight", None)
    if cfg["tie_weights"]:
        head = out["tok_emb.weight"]
    elif head is None:
        raise ValueError("the weights have no lm_head.weight and the config does not tie it")
    out["head.weight"] = head
    for i in range(cfg["n_layer"]):
        p = f"layers.{i}."
        out.update(layer_weights(p, functools.partial(_pop_part, src, p)))
    src = {k: v for k, v in src.items() if not k.endswith("rotary_emb.inv_freq")}  # a buffer, recomputed
    if src:
        raise ValueError(f"unexpected weights: {sorted(src)[:8]}")
    return out


def read(path: Path) -> Llama:
    """The model in the HF directory `path` (on CPU, fp32, eval mode)."""
    hf = json_file(path / "config.json")
    cfg = native_config(hf)
    lm = build("llama", cfg, tokenizer(path, hf).spec(), weights=state_dict(read_weights(path, allow_bin=True), cfg))
    assert isinstance(lm, Llama)
    return lm.eval()


def _pop_part(src: dict[str, torch.Tensor], prefix: str, part: str) -> torch.Tensor:
    """Layer `prefix`'s weight `part` (the family's name) from HF's tensors, taken out."""
    return src.pop(prefix + HF_PARTS[part] + ".weight")


READER = Reader("hf-llama", "a HF LLaMA or Mistral directory (config.json, weights, tokenizer.json)", claims, read, turn_stops=stop_strings)
