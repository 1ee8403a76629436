"""Engine-side request and event objects: what the API hands the scheduler, and what flows back.

A `Generation` is one generate request as the engine sees it: token ids to consume, the
sampling parameters, limits, and an asyncio-safe channel back to the API. The scheduler
thread only ever calls `Generation.push`; the event loop only ever iterates it.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from app.store import StateBlobs
from model import State
from model.sampling import SamplingParams


class EngineError(Exception):
    """A request the engine could not carry out (the session is left unchanged)."""


class EmptyContext(EngineError):
    """Nothing to condition on: a fresh session of a model without BOS, and no prompt."""


class QueueFull(EngineError):
    """The scheduler's queue is at its configured limit; the client should retry later."""


@dataclass(frozen=True)
class StateSource:
    """Where a request's starting state comes from: the bytes in Redis, or a hot-cached
    state whose version Redis has just confirmed (then `blobs` is None)."""

    session_id: str | None
    version: int
    commit_id: str
    n_tokens: int
    blobs: StateBlobs | None = None
    cached: State | None = None
    snapshot_bytes: int = 0  # what is stored now, for the delta-or-snapshot decision
    delta_bytes: int = 0

    @classmethod
    def from_bytes(cls, blob: bytes, n_tokens: int) -> StateSource:
        """A state given as one snapshot (no session behind it)."""
        return cls(None, 0, "", n_tokens, StateBlobs(blob), snapshot_bytes=len(blob))


@dataclass(frozen=True)
class Commit:
    """What a finished request writes (a delta or a snapshot), and the new state itself
    for the hot cache once the write has succeeded."""

    n_tokens: int
    snapshot: bytes | None
    delta: bytes | None
    state: State

    @property
    def nbytes(self) -> int:
        return len(self.snapshot or self.delta or b"")


@dataclass(frozen=True)
class TokenEvent:
    index: int
    id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class Finished:
    text: str
    finish_reason: str  # "length" | "stop" | "eos"
    token_ids: list[int]
    commit: Commit

    @property
    def n_tokens(self) -> int:
        return self.commit.n_tokens


@dataclass(frozen=True)
class Failed:
    error: BaseException


@dataclass
class Generation:
    """One generate request: consume `prompt`, then sample up to `max_tokens` tokens."""

    source: StateSource
    prompt: list[int]
    params: SamplingParams
    seed: int | None
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    result: Finished | None = None
    _cancelled: threading.Event = field(default_factory=threading.Event)

    # -- engine thread side ------------------------------------------------------------------
    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def push(self, event: TokenEvent | Finished | Failed) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            self._cancelled.set()

    # -- event loop side ---------------------------------------------------------------------
    def cancel(self) -> None:
        """Abandon the request; the scheduler drops it before its next token step."""
        self._cancelled.set()

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> TokenEvent:
        if self.result is not None:
            raise StopAsyncIteration
        event = await self.queue.get()
        if isinstance(event, Failed):
            raise event.error
        if isinstance(event, Finished):
            self.result = event
            raise StopAsyncIteration
        return event
