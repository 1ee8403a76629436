"""Server-Sent Events framing shared by the session routes and the OpenAI routes."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Protocol

from fastapi import Request
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.background import BackgroundTask

from . import errors


class Closes(Protocol):
    """What a response closes when it ends: a `Run`, or the runs of several choices."""

    async def close(self) -> None: ...


def sse_json(data: dict) -> str:
    # ASCII-only JSON: generated text can hold characters (U+2028, U+0085, ...) that some
    # SSE clients take for line breaks; escaped, every event is one line of plain ASCII
    return json.dumps(data, ensure_ascii=True, separators=(",", ":"))


async def until_disconnect(request: Request) -> None:
    """Returns when the client hangs up."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def guarded(
    run: Closes, frames: AsyncIterator[ServerSentEvent], error_event: str | None
) -> AsyncIterator[ServerSentEvent]:
    """`frames`; if they fail once streaming has begun (too late for a status code), one
    error frame with the usual error body, and nothing was committed. The run is closed
    either way."""
    try:
        async for frame in frames:
            yield frame
    except Exception as exc:
        etype, message = errors.classify(exc)
        yield ServerSentEvent(data=sse_json(errors.body(etype, message)), event=error_event)
    finally:
        with contextlib.suppress(BaseException):
            await run.close()


def respond(
    run: Closes, frames: AsyncIterator[ServerSentEvent], headers: dict[str, str] | None = None
) -> EventSourceResponse:
    """The streaming response; the run is closed when it ends, however it ends."""
    return EventSourceResponse(frames, headers=headers, background=BackgroundTask(run.close), ping=15)
