"""Finding and loading checkpoints: by shipped name or by directory, in either layout.

Two layouts: recur's native one (`model/native.py`: config.json names the family) and the
original / HF Transformer-XL one (`model/hf.py`: config.json without "family"). `load`
tells them apart by config.json and hands the directory to that layout's reader. Shipped
checkpoints live in `model/weights/<name>/` and load by name.

The imports run one way, native <- hf <- checkpoint; `build`, `families` and `save` are
native's, offered here as part of the checkpoint API. Nothing here unpickles.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from . import hf, native
from .family import LanguageModel
from .native import build, families, save

__all__ = ["WEIGHTS_DIR", "build", "families", "init", "load", "resolve", "resolve_device", "save", "shipped"]

WEIGHTS_DIR = Path(__file__).parent / "weights"

# checkpoint layout -> the reader that builds its model (on CPU, fp32)
READERS: dict[str, Callable[[Path], LanguageModel]] = {"native": native.read, "hf": hf.read}


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


def layout(path: Path) -> str:
    """"native" where config.json names a model family, else "hf" (issue 9)."""
    return "native" if "family" in json.loads((path / "config.json").read_text()) else "hf"


def load(name_or_dir: str | Path, device: str | torch.device = "auto", precision: str = "auto") -> LanguageModel:
    """Load a checkpoint by shipped name or directory, in eval mode on `device`.

    precision: "fp32", "bf16" (autocast, on CUDA or CPU) or "auto" (bf16 on CUDA, else fp32).
    """
    path = resolve(name_or_dir)
    lm = READERS[layout(path)](path)
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
