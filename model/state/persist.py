"""The persistence policy's answer for one commit (`Persist`) and the bytes it writes
(`encode`): a pure function of the state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .blob import FORMAT_VERSION, STORAGE_DTYPES, StateError, peek, precision_of
from .precision import STORED
from .protocol import State


@dataclass(frozen=True)
class Persist:
    """How a commit stores a single-stream state. `since` None: a snapshot. Else a delta
    of what changed since the stored state's `since` tokens, while the stored snapshot and
    deltas with it (`stored` bytes, and the new delta) stay within twice what the state's
    own snapshot would take, or within `delta_budget` (what the deltas may still grow
    before they outweigh the stored snapshot); else a snapshot, which replaces the deltas.
    So reading a state back never reads more than about twice its bytes, and a state
    that only grows (a cache of keys and values before its window is full: each delta is
    its new positions, none overwritten) is never rewritten whole: each commit writes
    what it added.

    `verified`: a snapshot of this very state that `read_state` has verified (an imported
    one, before any token): a snapshot commit writes it as it is, when it is already in
    the form `to_bytes` would write, instead of serialising and checksumming the state
    again (for a full SmolLM2 state, about 0.2 s of the encoder thread per import)."""

    dtype: str = "float32"
    since: int | None = None
    delta_budget: int = 0
    stored: int | None = None
    verified: bytes | None = None


@dataclass(frozen=True)
class Encoded:
    """A state's bytes as a commit writes them."""

    kind: Literal["snapshot", "delta"]
    blob: bytes


def encode(state: State, persist: Persist) -> Encoded:
    """The bytes a commit of `state` writes, as `persist` asks: a pure function of the state."""
    if persist.since is not None:
        delta = state.delta_bytes(persist.since, persist.dtype)
        if len(delta) <= persist.delta_budget:
            return Encoded("delta", delta)
        if persist.stored is not None and persist.stored + len(delta) <= 2 * snapshot_size(
            state, persist.dtype
        ):
            return Encoded("delta", delta)
    if persist.verified is not None and in_stored_form(persist.verified, state, persist.dtype):
        return Encoded("snapshot", persist.verified)
    return Encoded("snapshot", state.to_bytes(persist.dtype))


def in_stored_form(blob: bytes, state: State, dtype: str) -> bool:
    """Whether `blob`, a verified snapshot of `state`, is stored as `state.to_bytes(dtype)`
    would store it: this format, float32 caches, and every float tensor in `dtype`. Then
    loading it gives exactly the state a replica holding `state` serves (a blob in another
    form is read converted, so it is written again in this one)."""
    try:
        declared = peek(blob)
    except StateError:
        return False
    h, want = declared.header, STORED[dtype]
    return (
        h.get("format") == FORMAT_VERSION
        and h.get("delta") is None
        and h.get("dtype") == dtype
        and precision_of(h) == "float32" == state.precision
        and all(d == want for d, _ in declared.tensors.values() if d in ("F32", "BF16", "F16"))
    )


def snapshot_size(state: State, dtype: str) -> int:
    """About the bytes of `state`'s snapshot in `dtype`, without serialising it: its
    persistent tensors' elements at the width each is stored in (a cache at a precision
    in its compact form; float tensors else in `dtype`; the header not counted)."""
    store = STORAGE_DTYPES[dtype].itemsize
    cache = 1 if state.precision == "int8" else STORAGE_DTYPES[state.precision].itemsize
    total = 0
    for name in state.persistent or tuple(state.tensors):
        t = state.tensors[name]
        if name in state.seq_dims and state.precision != "float32":
            total += t.numel() * cache
        elif t.is_floating_point():
            total += t.numel() * store
        else:
            total += t.numel() * t.element_size()
    return total
