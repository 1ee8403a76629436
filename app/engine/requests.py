"""What the engine is asked to do, and what flows back: one kind of request for every use.

A `Request` teacher-forces a prompt into a starting state (returning the prompt's
log-probs when asked), then samples 0..`max_tokens` tokens, and hands back the new state
with the bytes its commit must write (`model.state.encode`). Creating a session (a fresh
state, 0 tokens), scoring (prompt log-probs, 0 tokens) and generating are this same
request with other fields.

The request carries everything in: its starting state (a live `State`, or stored bytes
for the engine to load: its loader thread parses them into a `Parsed`) and how the new
state must be encoded. Nothing flows back but
events, so the engine never calls the code that submitted it. The engine thread only
ever hands events to an `Outbox`; the event loop only ever iterates the request.

This module imports only `model/`.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Literal

import torch

from model import ContextFull, State, StateError
from model.grammar import Matcher
from model.sampling import SamplingParams
from model.state import Encoded, Persist

FinishReason = Literal["length", "stop", "eos"]


class EngineError(Exception):
    """A request the engine could not carry out (the session is left unchanged)."""


class EmptyContext(EngineError):
    """Nothing to condition on: a fresh session of a model without BOS, and no prompt."""


class ModelFailed(EngineError):
    """The model raised in a step that served this request: nothing of it was committed."""


class NonFinite(EngineError):
    """A session's state that this model's step turns non-finite (say, one imported with
    values near float32's limit): the request fails, and nothing of it is committed."""


class QueueFull(EngineError):
    """The scheduler's queue is at its configured limit; the client should retry later."""


@dataclass(frozen=True)
class Stored:
    """A starting state as stored bytes: a snapshot, the deltas committed after it in
    order, and the number of tokens its owner records (a state whose bytes say otherwise
    is refused: its stored parts are inconsistent)."""

    snapshot: bytes
    deltas: tuple[bytes, ...]
    n_tokens: int


@dataclass(frozen=True)
class Parsed:
    """A `Stored` start once the engine's loader thread has parsed and verified its bytes:
    the persistent tensors, from which the engine thread only rebuilds the caches; or the
    error the bytes met, which fails the request there."""

    tensors: dict[str, torch.Tensor] | None
    error: Exception | None = None


Alternatives = tuple[tuple[int, float], ...]  # (token id, log-prob), most probable first


@dataclass(frozen=True)
class TokenEvent:
    index: int
    id: int
    text: str  # its text as the session's state consumed it (a stop token's included)
    logprob: float  # behaviour log-prob (model.sampling)
    top: Alternatives = ()  # the request's `top_logprobs` most probable tokens, same distribution
    stop_text: str = ""  # ending the generation by its id (EOS, a stop_token_id): its own text, `text`'s end


@dataclass(frozen=True)
class Finished:
    """A request's outcome: the sampled tokens, the new state and the bytes to commit."""

    text: str
    finish_reason: FinishReason
    token_ids: list[int]
    prompt_logprobs: list[float | None]  # per prompt token when asked (None: no context)
    state: State  # the new state, owning its memory (`State.compact`)
    encoded: Encoded | None  # as the request's `persist` asked; None when it asked for none
    loaded: State | None  # the starting state, when the engine loaded it from bytes
    prompt_top: list[Alternatives] = field(default_factory=list)  # per prompt token, with top_logprobs

    @property
    def n_tokens(self) -> int:
        return int(self.state.n_tokens[0])


@dataclass(frozen=True)
class Failed:
    error: BaseException

    @classmethod
    def of(cls, exc: BaseException) -> Failed:
        """A step's exception as its requests see it: the engine's own errors and a damaged
        state as they are, anything else (the model raising) as ModelFailed, which names
        the error's type but not its text (the log has the whole of it)."""
        if isinstance(exc, (EngineError, StateError, ContextFull)):
            return cls(exc)
        failed = ModelFailed(
            f"the model failed in a step serving this request ({type(exc).__name__}); nothing of "
            "the request was committed, and the server log has the details"
        )
        failed.__cause__ = exc
        return cls(failed)


@dataclass(frozen=True)
class Logprobs:
    """What a generation reports besides each sampled token's behaviour log-prob: `top`
    most probable alternatives per token (under the distribution it was drawn from), and
    with `prompt` the prompt tokens' log-probs (the model's own, with `top` alternatives)."""

    top: int = 0
    prompt: bool = False


@dataclass
class Request:
    """Consume `prompt` into `start` (None: a fresh state), then sample up to `max_tokens`
    tokens, stopping early at EOS (unless `params.ignore_eos`), one of
    `params.stop_token_ids` or a `stop` string (neither before `params.min_tokens`);
    encode the new state as `persist` asks (None: nothing to write). With a `grammar`,
    only the tokens it allows are drawn (EOS once it is complete)."""

    start: State | Stored | Parsed | None
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int | None = None
    max_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    prompt_logprobs: bool = False
    persist: Persist | None = None
    top_logprobs: int = 0  # alternatives per sampled token (and prompt token, with prompt_logprobs)
    client: str = ""  # who asks (an API key's owner, or, keyless, an address): the scheduler's fairness
    grammar: Matcher | None = None  # the output's grammar (compiled off the engine thread), its own copy
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    result: Finished | None = None
    sent: int = 0  # events the engine has handed out (engine thread)
    taken: int = 0  # events its consumer has taken (event loop)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    # -- engine thread side ------------------------------------------------------------------
    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def unread(self) -> int:
        """Events sent and not yet taken: what a stream's reader has left unread."""
        return self.sent - self.taken

    # -- event loop side ---------------------------------------------------------------------
    def cancel(self) -> None:
        """Abandon the request; the engine drops it before its next step."""
        self._cancelled.set()

    def __aiter__(self) -> Request:
        return self

    async def __anext__(self) -> TokenEvent:
        if self.result is not None:
            raise StopAsyncIteration
        event = await self.events.get()
        self.taken += 1
        if isinstance(event, Failed):
            raise event.error
        if isinstance(event, Finished):
            self.result = event
            raise StopAsyncIteration
        return event

    async def finished(self) -> Finished:
        """Wait for the outcome, skipping token events; abandoned if the waiter is cancelled."""
        try:
            async for _ in self:
                pass
        except asyncio.CancelledError:
            self.cancel()
            raise
        assert self.result is not None
        return self.result


Event = TokenEvent | Finished | Failed


def _deliver(batch: list[tuple[Request, Event]]) -> None:
    for req, event in batch:
        req.events.put_nowait(event)


def deliver(req: Request, event: Event) -> None:
    """Hand one event to its request's event loop, from a thread of the engine's other than
    its own (the encoder's), once the engine thread has handed out all the request's others."""
    req.sent += 1
    try:
        req.loop.call_soon_threadsafe(_deliver, [(req, event)])
    except RuntimeError:  # the loop has closed: nobody is listening any more
        req.cancel()


class Outbox:
    """The events of one engine step, handed to the event loop together at its end: one
    wake-up of the loop per step, not one per token (with 16 streams the loop would
    otherwise be woken 16 times per step, each time taking the GIL from the engine)."""

    def __init__(self) -> None:
        self._batch: list[tuple[Request, Event]] = []

    def put(self, req: Request, event: Event) -> None:
        req.sent += 1
        self._batch.append((req, event))

    def flush(self) -> None:
        batch, self._batch = self._batch, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Request, Event]]] = {}
        for req, event in batch:
            by_loop.setdefault(req.loop, []).append((req, event))
        for loop, events in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, events)
            except RuntimeError:  # the loop has closed: nobody is listening any more
                for req, _ in events:
                    req.cancel()
