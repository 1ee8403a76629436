"""Server-Sent Events framing shared by the session routes and the OpenAI routes, and its
description in the OpenAPI document (each event's name, data model and id)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol, TypeVar

from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.sse import SendTimeoutError
from starlette.background import BackgroundTask
from starlette.types import Receive, Scope, Send

from . import errors
from .error_types import ErrorType

log = logging.getLogger("recur.api")
T = TypeVar("T")

# how long a stream has, once the server is told to stop, to send its final event before
# sse_starlette cancels it (it needs a moment only: the event is written at once)
SHUTDOWN_GRACE = 5.0
SHUTTING_DOWN = (
    "the server is shutting down: this stream ends here, as if the client had hung up "
    "(nothing more is generated); retry on a server that is up"
)


class Closes(Protocol):
    """What a response closes when it ends: a `Run`, or the runs of several choices."""

    async def close(self) -> None: ...


def sse_json(data: dict) -> str:
    # ASCII-only JSON: generated text can hold characters (U+2028, U+0085, ...) that some
    # SSE clients take for line breaks; escaped, every event is one line of plain ASCII
    return json.dumps(data, ensure_ascii=True, separators=(",", ":"))


async def guarded(
    run: Closes, frames: AsyncIterator[ServerSentEvent], error_event: str | None
) -> AsyncIterator[ServerSentEvent]:
    """`frames`; if they fail once streaming has begun (too late for a status code), one
    error frame with the usual error body, and nothing was committed. If the server is
    told to stop (Ctrl-C, SIGTERM) mid-stream, one `not_ready` error frame ends it, and the
    run ends as if its client had hung up. The run is closed either way."""

    async def stopped() -> ServerSentEvent:
        return ServerSentEvent(
            data=sse_json(errors.body(ErrorType.not_ready, SHUTTING_DOWN)), event=error_event
        )

    try:
        async for frame in until_stopped(frames, stopped):
            yield frame
    except Exception as exc:
        etype, message = errors.classify(exc)
        yield ServerSentEvent(data=sse_json(errors.body(etype, message)), event=error_event)
    finally:
        with contextlib.suppress(BaseException):
            await run.close()


async def until_stopped(items: AsyncIterator[T], last: Callable[[], Awaitable[T]]) -> AsyncIterator[T]:
    """`items`; if the server is told to stop (Ctrl-C, SIGTERM) before they end, the item
    being awaited is cancelled, `items` closed, and `last()`'s item ends them instead: a
    stream's final event, saying why it ends (SHUTTING_DOWN)."""
    stopping = asyncio.ensure_future(_Stream.server_stopping())
    try:
        async for item in _until(stopping, items):
            yield item
    except _Stopped:
        yield await last()
    finally:
        stopping.cancel()


class _Stopped(Exception):
    """The server was told to stop while a stream was live."""


async def _until(stopping: asyncio.Future, frames: AsyncIterator[T]) -> AsyncIterator[T]:
    """`frames` until they end or `stopping` is done, whichever comes first (the frame
    being awaited then is cancelled, `frames` closed, and _Stopped raised)."""
    it = aiter(frames)
    try:
        while not stopping.done():
            step = asyncio.ensure_future(anext(it))
            await asyncio.wait((step, stopping), return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                with contextlib.suppress(BaseException):
                    await step
                raise _Stopped
            try:
                frame = step.result()
            except StopAsyncIteration:
                return
            yield frame
        raise _Stopped
    finally:
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(BaseException):
                await aclose()


def respond(
    run: Closes,
    frames: AsyncIterator[ServerSentEvent] | AsyncIterator[ServerSentEvent | bytes],
    headers: dict[str, str] | None = None,
    send_timeout: float = 0,
) -> EventSourceResponse:
    """The streaming response (a frame may be events already encoded, as bytes); the run is
    closed when it ends, however it ends. A client
    that reads nothing for `send_timeout` seconds (0: never) is dropped, as if it had hung
    up: a stream never waits on it for longer."""
    return _Stream(
        frames,
        headers=headers,
        background=BackgroundTask(run.close),
        ping=15,
        send_timeout=send_timeout or None,
        # on shutdown, the frames (`guarded`) write their final event before the cut
        shutdown_grace_period=SHUTDOWN_GRACE,
    )


class _Stream(EventSourceResponse):
    """An event stream whose client, when it stops reading past the send timeout, is
    dropped quietly (a warning), not with an error's traceback."""

    @staticmethod
    async def server_stopping() -> None:
        """Returns when the server (uvicorn) is told to stop: sse_starlette's own watch."""
        await EventSourceResponse._listen_for_exit_signal()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            log.warning("dropped a stream whose client read nothing for %s s", self.send_timeout)


# -- the OpenAPI description of the streams ----------------------------------------------------
# OpenAPI 3.2's way to describe Server-Sent Events, which FastAPI and schemathesis read in a
# 3.1 document too: `itemSchema` is the schema of one event, an object of the SSE fields
# (`event`, `data`, `id`), and `data` holds JSON of a model (contentMediaType/contentSchema).


def json_of(*models: type[BaseModel]) -> dict:
    """An SSE `data` field that holds the JSON of one of `models`."""
    refs = [{"$ref": f"#/components/schemas/{m.__name__}"} for m in models]
    return {
        "type": "string",
        "contentMediaType": "application/json",
        "contentSchema": refs[0] if len(refs) == 1 else {"anyOf": refs},
    }


def named_events(events: dict[str, tuple[type[BaseModel], str | None]]) -> dict:
    """`itemSchema` of a stream of named events: each name -> (the model its data is the
    JSON of, the pattern of its `id`, or None where the id is not promised)."""
    branches = []
    for name, (model, id_pattern) in events.items():
        fields: dict = {"event": {"const": name}, "data": json_of(model)}
        if id_pattern is not None:
            fields["id"] = {"type": "string", "pattern": id_pattern}
        branches.append({"type": "object", "required": ["event", "data"], "properties": fields})
    return {"oneOf": branches}


def data_events(*models: type[BaseModel], last: str | None = "[DONE]") -> dict:
    """`itemSchema` of a stream of unnamed events (OpenAI's): each `data` the JSON of one of
    `models`, and the stream's `last` data a bare string."""
    data = json_of(*models)
    if last is not None:
        data = {"anyOf": [{"const": last}, data]}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {"event": {"const": "message"}, "data": data},
    }


def stream_response(description: str, item_schema: dict) -> dict:
    """A `responses=` entry's `text/event-stream` content."""
    return {"description": description, "content": {"text/event-stream": {"itemSchema": item_schema}}}
