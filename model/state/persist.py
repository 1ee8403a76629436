"""The persistence policy's answer for one commit (`Persist`) and the bytes it writes
(`encode`): a pure function of the state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .protocol import State


@dataclass(frozen=True)
class Persist:
    """How a commit stores a single-stream state. `since` None: a snapshot. Else a delta
    of what changed since the stored state's `since` tokens, unless it would exceed
    `delta_budget` bytes (what the stored deltas may still grow before reading them back
    costs more than one snapshot): then a snapshot, which also replaces the deltas."""

    dtype: str = "float32"
    since: int | None = None
    delta_budget: int = 0


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
    return Encoded("snapshot", state.to_bytes(persist.dtype))
