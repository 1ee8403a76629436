"""HF `MambaForCausalLM` and `Mamba2ForCausalLM` checkpoints, read into the native families.

A source directory holds
    config.json         the HF `MambaConfig` / `Mamba2Config` ("model_type": "mamba" | "mamba2")
    model.safetensors   or its shards (model.safetensors.index.json)
    tokenizer.json      when present: the HF tokenizer, carried into the native checkpoint

`read(DIR)` builds the native `Mamba` / `Mamba2` (`model/mamba.py`, `model/mamba2.py`);
`recur convert` (`model/convert.py`, whose registry picks this reader, `READER`, from
config.json's model_type) writes it as a native checkpoint, and `model.load(SRC)` reads the source
directly. Parameter names are HF's without the "backbone." prefix, so the conversion is a
rename plus the head's tying. Without tokenizer.json the model gets the byte tokenizer,
when its vocabulary holds it (ids 0..257), else reading fails with a clear error.

Only safetensors are read: nothing here unpickles. This module builds on the native format
(`model/native.py`) and must never import `model/checkpoint.py`, which picks this reader.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from .family import LanguageModel
from .hf_files import read_weights, tokenizer_spec
from .native import build, fingerprint
from .reader import TGT_LEN, Reader, config_json

MODEL_TYPES = {"mamba": "mamba", "mamba2": "mamba2"}  # HF model_type -> native family


def claims(path: Path) -> bool:
    """Whether `path` is a directory whose config.json this reader converts."""
    return config_json(path).get("model_type") in MODEL_TYPES


def _number(x: Any) -> float:
    """A float from config.json: transformers writes infinity as {"__float__": "Infinity"}."""
    return float(x["__float__"] if isinstance(x, dict) else x)


def native_config(hf: dict[str, Any], **overrides: Any) -> tuple[str, dict[str, Any]]:
    """A HF Mamba / Mamba-2 config dict -> (the native family, its config fields)."""
    family = MODEL_TYPES.get(hf.get("model_type", ""))
    if family is None:
        raise ValueError(f"config.json describes a {hf.get('model_type')!r} model, not mamba or mamba2")
    if (
        hf.get("hidden_act", "silu") != "silu"
        or hf.get("norm_before_gate", False)
        or not hf.get("rms_norm", True)
    ):
        raise ValueError("only the published Mamba variants convert: silu, and Mamba-2's norm after the gate")
    d, expand = hf["hidden_size"], hf.get("expand", 2)
    if hf.get("intermediate_size", expand * d) != expand * d:
        raise ValueError(
            f"intermediate_size {hf['intermediate_size']} is not expand * hidden_size = {expand * d}"
        )
    cfg: dict[str, Any] = {
        "vocab_size": hf["vocab_size"],
        "n_layer": hf["num_hidden_layers"],
        "d_model": d,
        "d_state": hf.get("state_size", 16 if family == "mamba" else 128),
        "d_conv": hf.get("conv_kernel", 4),
        "expand": expand,
        "conv_bias": bool(hf.get("use_conv_bias", True)),
        "bias": bool(hf.get("use_bias", False)),
        "tie_weights": bool(hf.get("tie_word_embeddings", family == "mamba")),
        "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
    }
    if family == "mamba":
        rank = hf.get("time_step_rank", "auto")
        cfg["dt_rank"] = math.ceil(d / 16) if rank == "auto" else int(rank)
    else:
        if hf.get("num_heads", expand * d // hf.get("head_dim", 64)) * hf.get("head_dim", 64) != expand * d:
            raise ValueError("num_heads * head_dim must equal expand * hidden_size")
        lo, hi = hf.get("time_step_limit", (0.0, math.inf))
        cfg.update(
            head_dim=hf.get("head_dim", 64),
            n_groups=hf.get("n_groups", 1),
            chunk_size=hf.get("chunk_size", 256),
            dt_limit=(_number(lo), _number(hi)),
        )
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    return family, cfg


def native_state_dict(lm: LanguageModel, source: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names -> `lm`'s: "backbone." dropped (and an older "embedding." renamed); a tied
    head is the embedding, whatever copy of it the source holds."""
    src = {k.removeprefix("backbone.").replace("embedding.", "embeddings."): v for k, v in source.items()}
    target = lm.state_dict()
    if lm.config.tie_weights:
        src.pop("lm_head.weight", None)
        src["lm_head.weight"] = src.get("embeddings.weight", torch.empty(0))
    missing, unexpected = sorted(set(target) - set(src)), sorted(set(src) - set(target))
    if missing or unexpected:
        raise ValueError(
            f"weights do not match the config: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    for name, t in target.items():
        if src[name].shape != t.shape:
            raise ValueError(
                f"weight {name} has shape {list(src[name].shape)}, the config implies {list(t.shape)}"
            )
    return {name: src[name].to(torch.float32) for name in target}


def read(path: str | Path, **overrides: Any) -> LanguageModel:
    """The native model for a HF Mamba / Mamba-2 directory (on CPU, fp32, eval mode);
    `overrides` replace native config fields (e.g. tgt_len, the serving chunk)."""
    path = Path(path)
    hf = json.loads((path / "config.json").read_text())
    family, cfg = native_config(hf, **overrides)
    lm = build(family, cfg, tokenizer_spec(path, hf))
    lm.load_state_dict(native_state_dict(lm, read_weights(path)), strict=True)
    lm.fingerprint = fingerprint(lm)
    return lm.eval()


READER = Reader("hf-ssm", "a HF Mamba or Mamba-2 directory (config.json, model.safetensors)", claims, read, flags=(TGT_LEN,))
