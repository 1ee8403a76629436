"""What the OpenAI-compatible routes (`completions.py`, `chat_completions.py`) share: a
body's generation and its choices as the sessions service starts them (`app.sessions.start_generations`:
each in a new or a continued session, or with `n` > 1 in forks); stop strings cut from the
returned text OpenAI's way; the response head; the chunk stream merged from every choice,
its usage chunk and `data: [DONE]`.

A route parses its own body and frames its own choices (a `OpenAIFramer`); everything between
the parsed body and the framed bytes is here, once. It never builds an error body
(http/errors.py) and never knows the model family.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from fastapi import Request
from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent

from app import logs
from app.config import Settings
from app.engine import Engine, FinishReason, Logprobs, TokenEvent
from app.sessions import Generation, Run, SessionService, start_generations

from ..http.deps import reply_bound, sampling_params, served_model
from ..http.disconnect import until_disconnect
from ..http.errors import ApiError, ErrorType, error_docs
from ..http.sse import data_events, guarded, respond, sse_json, stream_response
from ..schemas import ErrorBody, SessionRef
from .schemas import CompletionUsage, OpenAIBody, PromptTokensDetails

# OpenAI knows no "eos": the model ending its text is a stop
FINISH: dict[FinishReason, Literal["stop", "length"]] = {"eos": "stop", "stop": "stop", "length": "length"}


log = logging.getLogger("recur.openai")

# the error types both OpenAI routes answer themselves (for their OpenAPI `responses`)
ERRORS = (
    ErrorType.invalid_request,
    ErrorType.model_not_found,
    ErrorType.session_not_found,
    ErrorType.session_busy,
    ErrorType.session_conflict,
    ErrorType.model_mismatch,
    ErrorType.prompt_too_long,
    ErrorType.queue_full,
    ErrorType.engine_stalled,
    ErrorType.storage_full,
    ErrorType.redis_unavailable,
    ErrorType.outcome_unknown,  # a commit Redis did not answer: it may have happened
    ErrorType.invalid_state,  # a session whose state the model cannot continue (non-finite)
    ErrorType.invalid_schema,  # chat's response_format or tools: a reply's shape that cannot be had
)


def route_responses(chunk: type[BaseModel], name: str, *errors: ErrorType) -> dict[int | str, dict[str, Any]]:
    """A route's OpenAPI `responses`: its chunk stream (`name` as OpenAI calls the chunk),
    then its own errors and those both routes answer."""
    events = data_events(chunk, ErrorBody)
    stream = stream_response(
        f"stream=true: `data: {{{name}}}` events (or `data: {{error}}`), then `data: [DONE]`", events
    )
    return {200: stream, **error_docs(*errors, *ERRORS)}


def generation(
    body: OpenAIBody,
    settings: Settings,
    max_tokens: int | None,
    engine: Engine,
    *,
    stop: list[str],
    logprobs: Logprobs,
    started: float,
) -> Generation:
    """What a body asks each of its choices to sample (`max_tokens` as `reply_bound` bounds it)."""
    capped = reply_bound(max_tokens, settings, engine)
    params = sampling_params(body, engine, capped)
    return Generation(params, capped, body.seed, stop, logprobs=logprobs, started=started)


def stop_strings(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def continued(body: OpenAIBody, engine: Engine, header_sid: str | None) -> str | None:
    """The session a request continues (body `session_id` or `X-Session-Id`), if any, once
    its body names the served model (or none)."""
    served_model(body.model, engine)
    if body.session_id and header_sid and body.session_id != header_sid:
        raise ApiError(
            ErrorType.invalid_request, "session_id and the X-Session-Id header name different sessions"
        )
    sid = body.session_id or header_sid
    if sid is not None:
        logs.session_id.set(logs.clip(sid))
    return sid


class StopText:
    """The text of one generation as an OpenAI route returns it: cut before the stop string
    that ended it, and without the stop token (EOS or a stop_token_id) that ended it
    (OpenAI's and vLLM's semantics; the session's state has still consumed them), unless
    `include` (vLLM's include_stop_str_in_output). While streaming, text that may be the start
    of a stop string is held back until the next tokens tell.

    A stop string ends a generation where the engine found it: completed by a token, once
    `min_tokens` tokens are out (app/engine/runner.py), so earlier occurrences stay."""

    def __init__(self, stop: Sequence[str], include: bool = False, min_tokens: int = 0):
        self.stop = [] if include else [s for s in stop if s]
        self.include = include
        self.min_tokens = min_tokens
        self.text = ""
        self.sent = 0
        self.tokens = 0
        self.cut: int | None = None

    def feed(self, ev: TokenEvent) -> str:
        """Add a token; returns the text that may go out now."""
        if self.cut is not None:
            return ""
        self.tokens += 1
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += ev.text if self.include else ev.text[: len(ev.text) - len(ev.stop_text)]
        if self.tokens >= self.min_tokens:  # the window the engine searched for this token
            found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            self.cut = min(found) if found else None
        end = self.cut if self.cut is not None else len(self.text) - self._held()
        return self._release(max(end, self.sent))

    def finish(self) -> str:
        """The rest, once the generation has ended: held-back text that was no stop."""
        return self._release(len(self.text) if self.cut is None else self.cut)

    def whole(self, events: Sequence[TokenEvent]) -> str:
        """A generation's whole returned text, not streamed."""
        return "".join(self.feed(ev) for ev in events) + self.finish()

    def _release(self, end: int) -> str:
        out, self.sent = self.text[self.sent : end], max(end, self.sent)
        return out

    def _held(self) -> int:
        """The longest end of the text that is the start of a stop string."""
        for n in range(min(len(self.text), max((len(s) for s in self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(self.text[-n:]) for s in self.stop):
                return n
        return 0


@dataclass
class Choice:
    """One choice of a response: its generation and its returned text."""

    index: int
    prompt: int  # the prompt of the batch it continues: choices i*n .. i*n+n-1 are prompt i's
    run: Run
    text: StopText
    cached: int = 0  # prompt tokens its session already held (prefix reuse): not prefilled

    def ref(self) -> SessionRef:
        assert self.run.meta is not None
        meta = self.run.meta
        return SessionRef(id=meta.id, version=meta.version, n_tokens=meta.n_tokens)

    @property
    def finish_reason(self) -> Literal["stop", "length"]:
        return FINISH[self.run.finish_reason]


@dataclass
class Choices:
    """The generations of one response, closed together (each releases its session)."""

    items: list[Choice] = field(default_factory=list)

    async def close(self) -> None:
        for c in self.items:
            await c.run.close()

    def usage(self) -> CompletionUsage:
        cached = sum(c.cached for c in self.items)
        prompt = sum(c.run.prompt_tokens for c in self.items) + cached
        completion = sum(len(c.run.tokens) for c in self.items)
        return CompletionUsage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


async def start(
    sessions: SessionService,
    settings: Settings,
    owner: str,
    sid: str | None,
    prompts: list[list[int]],
    gen: Generation,
    *,
    n: int = 1,
    include_stop: bool = False,
    user: str | None = None,
) -> Choices:
    """`n` choices per prompt, choices i*n .. i*n+n-1 for prompt i (OpenAI's order), as the
    sessions service starts them (`app.sessions.start_generations`: all start, or none does). `user` is
    OpenAI's end-user id: logged for the operator (with the session), never used."""
    _check_batch(settings, sid, len(prompts), n)
    started = await start_generations(sessions, owner, sid, prompts, gen, n)
    choices = Choices(
        [
            Choice(
                i, i // n, r, StopText(gen.stop, include_stop, gen.params.min_tokens), started.cached[i // n]
            )
            for i, r in enumerate(started.runs)
        ]
    )
    # the runs started in tasks of their own: the request's log context learns the session here
    logs.session_id.set(choices.items[0].run.writer.meta.id)
    if user is not None:
        log.info("completion for user %r", user, extra={"openai_user": user})
    return choices


def _check_batch(settings: Settings, sid: str | None, prompts: int, n: int) -> None:
    if sid is not None and prompts != 1:
        raise ApiError(
            ErrorType.invalid_request,
            f"a session has one continuation: send one prompt with session_id, not {prompts}",
        )
    if n * prompts > settings.max_batch_size:
        raise ApiError(
            ErrorType.invalid_request,
            f"n: {n} choices for each of {prompts} prompt(s) are {n * prompts} generations; this server "
            f"runs at most {settings.max_batch_size} (max_batch_size) in one request",
        )


def head(prefix: str, model: str, fingerprint: str, choices: Choices) -> dict[str, Any]:
    """The fields every body and chunk of a response repeats. `session_id` is the first
    choice's (as the X-Session-Id header is); each choice reports its own session."""
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": fingerprint,
        "session_id": choices.items[0].run.writer.meta.id,
    }


def session_header(choices: Choices) -> dict[str, str]:
    return {"X-Session-Id": choices.items[0].run.writer.meta.id}


async def complete(choices: Choices, request: Request) -> None:
    """Run every choice to its commit, without streaming. A client that hangs up abandons
    them all (nothing is committed for a choice not yet committed)."""
    hangup = asyncio.ensure_future(until_disconnect(request))
    # one watcher of the request, shielded: each run's `complete` cancels only its own view
    tasks = [asyncio.ensure_future(c.run.complete(asyncio.shield(hangup))) for c in choices.items]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in (*tasks, hangup):
            t.cancel()
        await choices.close()


class OpenAIFramer(Protocol):
    """A route's shapes: the chunk body around choice entries, and each entry."""

    def chunk(self, entries: list[Any], usage: CompletionUsage | None) -> BaseModel: ...
    def opening(self, choice: Choice) -> BaseModel | None: ...
    def token(self, choice: Choice, event: TokenEvent | None, text: str) -> BaseModel | None: ...
    def closing(self, choice: Choice) -> BaseModel | Sequence[BaseModel]: ...


def stream(
    choices: Choices, framer: OpenAIFramer, include_usage: bool, send_timeout: float = 0
) -> EventSourceResponse:
    """The SSE response: each choice's chunks as its tokens come, a closing chunk per choice
    once it has committed (its finish_reason and session), the usage chunk if asked, then
    `data: [DONE]` (after an error chunk too: the SDK raises `{"error": ...}` chunks)."""
    frames = guarded(choices, _frames(choices, framer, include_usage), error_event=None)
    return respond(choices, _then_done(frames), headers=session_header(choices), send_timeout=send_timeout)


async def _frames(
    choices: Choices, framer: OpenAIFramer, include_usage: bool
) -> AsyncIterator[ServerSentEvent]:
    def frame(entry: BaseModel | None) -> ServerSentEvent | None:
        return None if entry is None else _event(framer.chunk([entry], None))

    for c in choices.items:
        if (f := frame(framer.opening(c))) is not None:
            yield f
    async for c, ev in _merged(choices):
        if ev is not None:
            f = frame(framer.token(c, ev, c.text.feed(ev)))
        else:  # committed: what was held back, then the finish reason and the session
            rest = c.text.finish()
            if rest and (f := frame(framer.token(c, None, rest))) is not None:
                yield f
            closing = framer.closing(c)
            entries = [closing] if isinstance(closing, BaseModel) else list(closing)
            for entry in entries[:-1]:
                if (f := frame(entry)) is not None:
                    yield f
            f = frame(entries[-1])
        if f is not None:
            yield f
    if include_usage:
        yield _event(framer.chunk([], choices.usage()))


def _event(body: BaseModel) -> ServerSentEvent:
    data = body.model_dump(mode="json")  # usage: null in every chunk but the last, as OpenAI's
    for part in (data, *data.get("choices", [])):
        if part.get("session", 0) is None:  # a session goes only where it is news
            del part["session"]
    return ServerSentEvent(data=sse_json(data))


async def _merged(choices: Choices) -> AsyncIterator[tuple[Choice, TokenEvent | None]]:
    """Every choice's token events as they come, and (choice, None) once it has committed."""
    queue: asyncio.Queue[tuple[Choice, TokenEvent | None] | BaseException] = asyncio.Queue()

    async def pump(c: Choice) -> None:
        try:
            async for ev in c.run.stream():
                queue.put_nowait((c, ev))
            queue.put_nowait((c, None))
        except Exception as exc:  # handed to the consumer, which frames it as the error chunk
            queue.put_nowait(exc)

    tasks = [asyncio.ensure_future(pump(c)) for c in choices.items]
    try:
        done = 0
        while done < len(tasks):
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            done += item[1] is None
            yield item
    finally:
        for t in tasks:
            t.cancel()


async def _then_done(frames: AsyncIterator[ServerSentEvent]) -> AsyncIterator[ServerSentEvent]:
    async for frame in frames:
        yield frame
    yield ServerSentEvent(data="[DONE]")
