"""Checkpoint I/O: a directory of `config.json`, `model.safetensors` and `tokenizer.json`.

    config.json      {"family": "transformer-xl", "config": {...dataclass fields...}}
    model.safetensors  weights (tied weights stored once)
    tokenizer.json   the tokenizer spec (`model.tokenizer.from_spec`)

Shipped checkpoints live in `model/weights/<name>/` and load by name. Weights are read
with safetensors only: nothing here unpickles. A directory in the original / HF
Transformer-XL layout (config.json without "family") is read by `model/hf.py`.

The fingerprint identifies a model exactly (family, config, tokenizer and every weight);
states carry it so a state is never run through a model it was not made by.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model

from . import tokenizer as tokenizers
from .family import LanguageModel

WEIGHTS_DIR = Path(__file__).parent / "weights"


def families() -> dict[str, type[LanguageModel]]:
    """Every model family, by name. The one registry."""
    from .rlt import RLT
    from .transformer_xl import TransformerXL

    return {cls.family: cls for cls in (TransformerXL, RLT)}


def shipped() -> list[str]:
    return sorted(p.name for p in WEIGHTS_DIR.iterdir() if (p / "config.json").is_file()) if WEIGHTS_DIR.is_dir() else []


def resolve(name_or_dir: str | Path) -> Path:
    path = Path(name_or_dir)
    if (path / "config.json").is_file():
        return path
    if (WEIGHTS_DIR / str(name_or_dir) / "config.json").is_file():
        return WEIGHTS_DIR / str(name_or_dir)
    raise FileNotFoundError(
        f"no checkpoint at {str(name_or_dir)!r}: not a directory with config.json, "
        f"and not a shipped model ({', '.join(shipped()) or 'none shipped'})"
    )


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def build(family: str, config: dict, tokenizer_spec: dict | None = None) -> LanguageModel:
    """A randomly initialised model of `family` (weights depend on torch's RNG state)."""
    try:
        cls = families()[family]
    except KeyError:
        raise ValueError(f"unknown model family {family!r}; known: {sorted(families())}") from None
    fields = {f.name for f in dataclasses.fields(cls.config_class)}
    unknown = set(config) - fields
    if unknown:
        raise ValueError(f"unknown {family} config keys: {sorted(unknown)}")
    lm = cls(cls.config_class(**config))
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
    (out / "config.json").write_text(json.dumps({"family": lm.family, "config": lm.config_dict()}, indent=2) + "\n")
    (out / "tokenizer.json").write_text(json.dumps(lm.tokenizer.spec() if lm.tokenizer else {"kind": "byte"}) + "\n")
    save_model(lm, str(out / "model.safetensors"))
    return out


def load(name_or_dir: str | Path, device: str | torch.device = "auto", precision: str = "auto") -> LanguageModel:
    """Load a checkpoint by shipped name or directory, in eval mode on `device`.

    precision: "fp32", "bf16" (autocast, CUDA only) or "auto" (bf16 on CUDA, else fp32).
    """
    path = resolve(name_or_dir)
    meta = json.loads((path / "config.json").read_text())
    if "family" not in meta:  # an original / HF Transformer-XL directory (issue 9)
        from . import hf

        lm: LanguageModel = hf.read(path)
    else:
        tok_path = path / "tokenizer.json"
        tok_spec = json.loads(tok_path.read_text()) if tok_path.is_file() else {"kind": "byte"}
        lm = build(meta["family"], meta["config"], tok_spec)
        load_model(lm, str(path / "model.safetensors"), strict=True)
        lm.fingerprint = fingerprint(lm)
    dev = resolve_device(device)
    if precision == "auto":
        precision = "bf16" if dev.type == "cuda" else "fp32"
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be fp32, bf16 or auto, not {precision!r}")
    lm.precision = precision
    return lm.to(dev).eval()


def init(
    directory: str | Path, family: str = "transformer-xl", seed: int = 0, **config: object
) -> LanguageModel:
    """Write a random-weight checkpoint (what `recur init` does) and return the model."""
    torch.manual_seed(seed)
    lm = build(family, {k: v for k, v in config.items() if v is not None})
    save(lm, directory)
    return lm.eval()
