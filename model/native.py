"""recur's own model format: the family registry, building a model, its fingerprint, and
the native checkpoint directory.

    config.json        {"family": "transformer-xl", "config": {...dataclass fields...}}
    model.safetensors  weights (tied weights stored once)
    tokenizer.json     the tokenizer spec (`model.tokenizer.from_spec`)

The fingerprint identifies a model exactly (family, config, tokenizer and every weight);
states carry it so a state is never run through a model it was not made by.

Weights are read with safetensors only: nothing here unpickles. This module knows only
the native layout; finding checkpoints, and other layouts, are `model/checkpoint.py`'s.
Its reader (`READER`) claims a directory whose config.json names a family.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from . import tokenizer as tokenizers
from .family import LanguageModel
from .gdn_hybrid import GDNHybrid
from .llama import Llama
from .mamba import Mamba
from .mamba2 import Mamba2
from .mamba2_hybrid import Mamba2Hybrid
from .reader import Reader, config_json
from .rlt import RLT
from .transformer_xl import TransformerXL


def families() -> dict[str, type[LanguageModel]]:
    """Every model family, by name. The one registry."""
    return {cls.family: cls for cls in (TransformerXL, RLT, Llama, Mamba, Mamba2, GDNHybrid, Mamba2Hybrid)}


def build(
    family: str,
    config: dict,
    tokenizer_spec: dict | None = None,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> LanguageModel:
    """A model of `family`: randomly initialised (weights depend on torch's RNG state), or
    holding `weights` (every one, strictly), made without the random init's cost."""
    try:
        cls = families()[family]
    except KeyError:
        raise ValueError(f"unknown model family {family!r}; known: {sorted(families())}") from None
    fields = {f.name for f in dataclasses.fields(cls.config_class)}
    unknown = set(config) - fields
    if unknown:
        raise ValueError(f"unknown {family} config keys: {sorted(unknown)}")
    cfg = cls.config_class(**config)
    if weights is None:
        lm = cls(cfg)
    else:
        lm = cls.without_init(cfg)
        lm.load_state_dict(weights, strict=True)
    lm.tokenizer = tokenizers.from_spec(tokenizer_spec or {"kind": "byte"})
    lm.fingerprint = fingerprint(lm)
    return lm


def fingerprint(lm: LanguageModel) -> str:
    h = hashlib.sha256()
    h.update(lm.family.encode())
    h.update(json.dumps(lm.config_dict(), sort_keys=True).encode())
    h.update(json.dumps(lm.tokenizer.spec() if lm.tokenizer else None, sort_keys=True).encode())
    for name, t in sorted(lm.state_dict().items()):
        t = t.detach().to("cpu", torch.float32).contiguous()
        h.update(name.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:16]


def save(lm: LanguageModel, directory: str | Path) -> Path:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(
        json.dumps({"family": lm.family, "config": lm.config_dict()}, indent=2) + "\n"
    )
    (out / "tokenizer.json").write_text(
        json.dumps(lm.tokenizer.spec() if lm.tokenizer else {"kind": "byte"}) + "\n"
    )
    save_model(lm, str(out / "model.safetensors"))
    return out


def read(path: Path) -> LanguageModel:
    """The model in the native checkpoint directory `path` (on CPU, fp32)."""
    meta = json.loads((path / "config.json").read_text())
    tok_path = path / "tokenizer.json"
    tok_spec = json.loads(tok_path.read_text()) if tok_path.is_file() else {"kind": "byte"}
    lm = build(meta["family"], meta["config"], tok_spec)
    load_model(lm, str(path / "model.safetensors"), strict=True)
    lm.fingerprint = fingerprint(lm)
    return lm


def claims(path: Path) -> bool:
    return "family" in config_json(path)


READER = Reader("native", "recur's native checkpoint directory (config.json names the family)", claims, read)
