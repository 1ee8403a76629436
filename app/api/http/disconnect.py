"""A client that hangs up before its request commits changes nothing.

Every route that writes or runs the model hands its service call to `Hangup` (a
dependency): if the client hangs up first, the call is cancelled (the engine drops its
request before its next step, the session's lock is released, nothing is committed) and
`ClientDisconnected` ends the request (499 in the access log: nobody is left to read an
answer). A request that asked to commit anyway (`on_disconnect: "commit"`) is not watched:
it runs to its commit whoever listens. Streamed generations watch the stream itself
(`app.sessions.Run`), and the OpenAI routes their choices (`openai/framing.py`: `complete`), the
same way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Annotated, TypeVar

from fastapi import Depends, Request

from app.sessions import ClientDisconnected

T = TypeVar("T")


async def until_disconnect(request: Request) -> None:
    """Returns when the client hangs up."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Hangup:
    """The request's watch for its client hanging up."""

    def __init__(self, request: Request):
        self.request = request
        self._body_read = asyncio.Event()

    async def body(self) -> bytes:
        """The request's body, for a `work` that reads it itself (`reads_body`): the watch
        starts once it is read, so that the two never take each other's messages."""
        try:
            chunks = [chunk async for chunk in self.request.stream() if chunk]
            if sum(map(len, chunks)) < 2**20:
                return b"".join(chunks)
            # (a large one is joined off the loop: a 47 MB state joined on it held every other
            # request's tokens for tens of milliseconds; bytes.join lets go of the GIL to copy)
            return await asyncio.to_thread(b"".join, chunks)
        finally:
            self._body_read.set()

    async def __call__(self, work: Awaitable[T], unwatched: bool = False, reads_body: bool = False) -> T:
        """The result of `work`, unless the client hangs up first (then ClientDisconnected,
        and `work` was cancelled). With `unwatched`, `work` runs to its end regardless. With
        `reads_body`, `work` reads the body through `self.body`, and the watch waits for it."""
        if unwatched:
            return await work
        if not reads_body:
            self._body_read.set()
        task = asyncio.ensure_future(work)
        hangup = asyncio.ensure_future(self._watch())
        try:
            await asyncio.wait({task, hangup}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task  # its cleanup (the lock's release) runs before the answer
                raise ClientDisconnected("the client disconnected; nothing was committed")
            return task.result()
        finally:
            task.cancel()
            hangup.cancel()

    async def _watch(self) -> None:
        await self._body_read.wait()
        await until_disconnect(self.request)


HangupDep = Annotated[Hangup, Depends(Hangup)]
