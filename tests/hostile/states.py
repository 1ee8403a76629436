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
    return lm, state_after(lm, list(range(1, 41)))


def state_after(lm: model.LanguageModel, tokens: list[int]) -> model.State:
    """The model's state after consuming `tokens` from a fresh one."""
    with torch.no_grad():
        return lm.consume(tokens, lm.new_state(1))[1]


def past_its_bound(lm: model.LanguageModel, state: model.State, extra: int = 3) -> model.State:
    """`state` with its first time axis (Transformer-XL's memory, RLT's encoder keys) `extra`
    rows longer than the family's bound and than the axes beside it, its oldest rows
    repeated: loading refuses such a state (`LanguageModel.check_state_tensors`), so only a
    live one, as the hot cache holds them, can be it. A step over it raises, batched or
    alone; splitting a batch trims each row's axes to the bound, which mends it."""
    name = next(iter(lm.time_axes()))
    return state.replace(**{name: torch.cat([state[name][:, :, :extra], state[name]], 2)})


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
