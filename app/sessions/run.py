"""A generation in progress: its tokens as they come, then its commit.

A `Run` holds its session's writer lock from `SessionService.generate` to its commit or
its close. It is the sessions service's own object: it commits through the service (the
fenced commit and the settlement, service.py), and always releases the lock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Protocol

from app import metrics
from app.engine import Finished, FinishReason, Request, TokenEvent
from app.store import SessionMeta, Writer
from app.tenants import Tenants
from app.transcript import Kind, Segment

log = logging.getLogger("recur.sessions")


class Transaction(Protocol):
    """The steps of a session's transaction that a run takes (`SessionService` is the one
    that makes runs): this module needs no more of it, so it does not import it."""

    @property
    def tenants(self) -> Tenants: ...
    async def commit(
        self, writer: Writer, res: Finished, owner: str, segment: Segment, tokens_hash: str | None = None
    ) -> SessionMeta: ...
    async def release(self, writer: Writer, owner: str) -> None: ...
    async def _finish(self, req: Request) -> Finished: ...


class ClientDisconnected(Exception):
    """The client hung up before the commit: nothing was committed."""


class Run:
    """One generation holding its session's writer lock: iterate `stream()` (tokens, then
    the commit), or await `complete()`. Always `close()` it (idempotent)."""

    def __init__(
        self,
        service: Transaction,
        req: Request,
        writer: Writer,
        owner: str,
        prompt: list[int],
        started: float,
    ):
        self.service = service
        self.req = req
        self.writer = writer
        self.owner = owner
        self.prompt = prompt
        self.prompt_tokens = len(prompt)
        self.started = started
        self.meta: SessionMeta | None = None  # the committed session, once committed
        self.tokens: list[TokenEvent] = []  # as handed to the client
        self.commit_on_disconnect = False  # `close` before the commit commits the tokens sent
        self.client: str | None = None  # whose stream it is, once admitted (`Tenants.starting`)
        self.reserved = 0  # tokens reserved for it in its tenant's bucket, once admitted
        self._ended = False
        self._committing_sent: asyncio.Future[None] | None = None
        metrics.PROMPT_TOKENS.inc(self.prompt_tokens)

    @property
    def version(self) -> int:
        """The version this generation commits as."""
        return self.writer.meta.version + 1

    async def stream(self) -> AsyncIterator[TokenEvent]:
        """Each token as it is sampled; after the last one the new state is committed
        (`self.meta`). An exception here means nothing was committed."""
        last = self.started
        async for ev in self.req:
            now = time.perf_counter()
            (metrics.INTER_TOKEN_LATENCY if self.tokens else metrics.TIME_TO_FIRST_TOKEN).observe(now - last)
            last = now
            metrics.GENERATION_TOKENS.inc()
            self.tokens.append(ev)
            yield ev
        res = self.result
        await self._end()
        self.meta = await self.service.commit(self.writer, res, self.owner, self.segment("generate"))
        metrics.E2E_REQUEST_LATENCY.observe(time.perf_counter() - self.started)
        metrics.REQUESTS_FINISHED.labels(res.finish_reason).inc()

    async def complete(self, disconnected: Awaitable[object]) -> SessionMeta:
        """Run to the commit without streaming. If `disconnected` (the client hanging up)
        completes first, the generation is abandoned and nothing is committed."""

        async def drain() -> None:
            async for _ in self.stream():
                pass

        work = asyncio.ensure_future(drain())
        watcher = asyncio.ensure_future(disconnected)
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise ClientDisconnected("the client disconnected; nothing was committed")
            work.result()
        finally:
            work.cancel()
            watcher.cancel()
            await self.close()
        assert self.meta is not None
        return self.meta

    @property
    def result(self) -> Finished:
        assert self.req.result is not None
        return self.req.result

    def segment(self, kind: Kind, tokens: list[TokenEvent] | None = None) -> Segment:
        """This generation's transcript segment: the prompt, then the tokens handed out (or
        `tokens`, those a kept generation commits)."""
        n, tokens = len(self.prompt), self.tokens if tokens is None else tokens
        return Segment(
            self.writer.meta.id,
            self.version,
            kind,
            self.writer.meta.n_tokens,
            self.prompt + [ev.id for ev in tokens],
            [False] * n + [True] * len(tokens),
            [None] * n + [ev.logprob for ev in tokens],
            dataclasses.asdict(self.req.params),
            self.req.seed,
            self.req.result.finish_reason if kind == "generate" and self.req.result else None,
        )

    @property
    def finish_reason(self) -> FinishReason:
        return self.result.finish_reason

    @property
    def text(self) -> str:
        return self.result.text

    async def close(self) -> None:
        """Stop the generation (if still running) and release the lock (if not committed).
        With `commit_on_disconnect`, a generation cut short first commits the tokens it had
        handed out: in a task of its own, which completes even when the caller that
        started it is being cancelled (as a stream's is when its client hangs up)."""
        self.req.cancel()
        if self.commit_on_disconnect and self.meta is None and self.tokens and self._committing_sent is None:
            # the tokens handed out by now, and no later one: the stream may yet take another
            # from the engine before it sees the close, and the commit and its transcript must
            # hold the same tokens
            self._committing_sent = asyncio.ensure_future(self._commit_sent(list(self.tokens)))
        if self._committing_sent is not None:
            await asyncio.shield(self._committing_sent)
        await asyncio.shield(self._end())
        await self.service.release(self.writer, self.owner)

    def keep_as(self, ttl: int, holder: str) -> None:
        """Its commit also keeps the session `ttl` seconds (sliding), held by `holder` (a
        response whose state it is: `SessionStore.delete`), in the same step; and leaves
        the tenant's ledger to the holder, which settles it with its own record
        (`Tenants.settle_kept`): one round trip for both."""
        self.writer.kept_as = (ttl, holder)

    def admitted(self, client: str, reserved: int) -> None:
        """Its place among `client`'s streams and `reserved` tokens are now its own."""
        self.client, self.reserved = client, reserved

    async def _end(self) -> None:
        """Once: the tokens handed out count against the tenant (committed or not); its
        stream's place and the tokens reserved and not drawn go back."""
        if not self._ended:
            self._ended = True
            await self.service.tenants.ended(self.owner, self.client, self.reserved, len(self.tokens))

    async def _commit_sent(self, handed: list[TokenEvent]) -> None:
        """Commit the starting state with the prompt and exactly the tokens handed out
        consumed: teacher-forced anew (a recurrent state cannot be rolled back), which by
        boundary invariance is the state the generation had after them. On failure the
        session stays as it was."""
        s = self.service
        try:
            await self._end()
            ids = self.prompt + [ev.id for ev in handed]
            res = await s._finish(Request(self.req.start, ids, persist=self.req.persist))
            self.meta = await s.commit(self.writer, res, self.owner, self.segment("keep", handed))
        except Exception:
            log.warning("could not commit the tokens of a generation cut short", exc_info=True)
        finally:
            await s.release(self.writer, self.owner)
