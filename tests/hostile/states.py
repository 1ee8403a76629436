"""Hostile states: real state blobs of the hostile servers' tiny models, with valid
checksums, made to lie in ways the byte format cannot catch by itself."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save as st_save

import model
from model.state import checksum_of

# what the issue's attacker imported: a token count at int64's edge, valid in every byte
NEAR_INT64_MAX = 2**63 - 8


def full_state(model_dir: Path) -> tuple[model.LanguageModel, model.State]:
    """The model and a state whose time axes are full (more tokens than its memory holds)."""
    lm = model.load(model_dir, device="cpu")
    with torch.no_grad():
        _, state = lm.consume(list(range(1, 41)), lm.new_state(1))
    return lm, state


def blob_with(model_dir: Path, *, n_tokens: int | None = None, fill: float | None = None) -> bytes:
    """A snapshot of a full state of the model at `model_dir`, its token count set to
    `n_tokens` and/or every float tensor filled with `fill`: checksum, shapes and
    fingerprint all valid."""
    lm, state = full_state(model_dir)
    changes = {}
    if n_tokens is not None:
        changes["n_tokens"] = torch.tensor([n_tokens], dtype=torch.long)
    if fill is not None:
        changes.update(
            {k: torch.full_like(t, fill) for k, t in state.tensors.items() if t.is_floating_point()}
        )
    return state.replace(**changes).to_bytes()


def raw_blob(tensors: dict[str, torch.Tensor], header: dict) -> bytes:
    """A safetensors blob of `tensors` with the recur header `header` plus the shapes and
    checksum the payload really has (so only what the caller chose is a lie)."""
    full = {
        "format": 1,
        "dtype": "float32",
        "delta": None,
        "shapes": {k: list(v.shape) for k, v in tensors.items()},
        "checksum": checksum_of(tensors),
        **header,
    }
    return st_save(tensors, metadata={"recur": json.dumps(full)})
