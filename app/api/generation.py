"""The one path from a request to a committed session, shared by the session routes and the
OpenAI-compatible routes: create a session, and run a generation from its writer lock to
its commit, streamed or collected, recording the token metrics on the way.

Routers only translate: into session events (sessions.py) or OpenAI chunks
(completions.py). Whatever happens, a `Run` ends with its lock released and, unless it
reached `commit`, the session exactly as it was.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import Request

from app import logs, metrics
from app.config import Settings
from app.engine import Commit, Engine, Generation, StateSource, TokenEvent
from app.store import SessionMeta, SessionStore, StateBlobs, Writer
from model.sampling import SamplingParams

from .errors import ApiError, ErrorType


def prompt_ids(engine: Engine, max_prompt_tokens: int, prompt: str | list[int]) -> list[int]:
    """The prompt as token ids of the served model, or 413/422."""
    ids = engine.tokenize(prompt)
    if len(ids) > max_prompt_tokens:
        raise ApiError(
            ErrorType.prompt_too_long,
            f"prompt has {len(ids)} tokens; this server accepts at most {max_prompt_tokens}",
        )
    bad = [i for i in ids if not 0 <= i < engine.vocab_size]
    if bad:
        raise ApiError(
            ErrorType.invalid_request,
            f"token id {bad[0]} is outside the model's vocabulary [0, {engine.vocab_size})",
        )
    return ids


def sampling_params(temperature: float, top_k: int, top_p: float) -> SamplingParams:
    try:
        return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    except ValueError as exc:
        raise ApiError(ErrorType.invalid_request, str(exc)) from None


def check_model(meta: SessionMeta, engine: Engine) -> None:
    if meta.fingerprint != engine.fingerprint:
        raise ApiError(
            ErrorType.model_mismatch,
            f"session {meta.id} belongs to model {meta.model!r} ({meta.fingerprint}); "
            f"this server runs {engine.name!r} ({engine.fingerprint})",
        )


async def create_session(
    engine: Engine, store: SessionStore, ids: list[int], ttl: int, owner: str
) -> SessionMeta:
    """A new session with BOS and `ids` consumed, owned by `owner`."""
    await store.ping()  # fail fast, before spending model time, when Redis is down
    consumed = await engine.new_session(ids)
    assert consumed.commit is not None and consumed.commit.snapshot is not None
    meta = await store.create(
        StateBlobs(consumed.commit.snapshot), consumed.n_tokens, engine.name, engine.fingerprint, ttl, owner
    )
    engine.remember(meta, consumed.commit)
    logs.session_id.set(meta.id)
    return meta


async def begin(
    engine: Engine, store: SessionStore, session_id: str, expected: int | None, owner: str
) -> tuple[Writer, StateSource]:
    """Take the session's writer lock and find its starting state: this replica's hot copy
    when Redis confirms it is current (then no state bytes travel), else the bytes Redis
    returns. On any error the lock is released."""
    held = engine.held(session_id)
    writer = await store.begin(session_id, expected, held.commit_id if held else None, owner)
    try:
        check_model(writer.meta, engine)
        return writer, engine.source(writer.meta, writer.state, held)
    except BaseException:
        await writer.release()
        raise


async def read(
    engine: Engine, store: SessionStore, session_id: str, expected: int | None, owner: str
) -> tuple[SessionMeta, StateSource]:
    """The committed state without taking the lock (read-only requests)."""
    held = engine.held(session_id)
    meta, blobs = await store.read(
        session_id, with_state=True, held_commit=held.commit_id if held else None, owner=owner
    )
    if expected is not None and meta.version != expected:
        raise ApiError(
            ErrorType.version_mismatch, f"session {session_id!r} is at version {meta.version}, not {expected}"
        )
    check_model(meta, engine)
    return meta, engine.source(meta, blobs, held)


async def commit(writer: Writer, engine: Engine, result: Commit) -> SessionMeta:
    """Write a finished request's state (delta or snapshot, fenced) and keep it hot."""
    meta = await writer.commit(result.n_tokens, snapshot=result.snapshot, delta=result.delta)
    engine.remember(meta, result)
    return meta


def sse_json(data: dict) -> str:
    # ASCII-only JSON: generated text can hold characters (U+2028, U+0085, ...) that some
    # SSE clients take for line breaks; escaped, every event is one line of plain ASCII
    return json.dumps(data, ensure_ascii=True, separators=(",", ":"))


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Run:
    """One generation holding its session's writer lock: iterate `stream()` (tokens, then
    the commit), or await `complete()`. Always `close()` it (idempotent)."""

    def __init__(self, engine: Engine, gen: Generation, writer: Writer, prompt_tokens: int, started: float):
        self.engine = engine
        self.gen = gen
        self.writer = writer
        self.prompt_tokens = prompt_tokens
        self.started = started
        self.meta: SessionMeta | None = None  # the committed session, once committed
        self.tokens: list[TokenEvent] = []
        metrics.PROMPT_TOKENS.inc(prompt_tokens)

    async def stream(self) -> AsyncIterator[TokenEvent]:
        """Each token as it is sampled; after the last one the new state is committed
        (`self.meta`). An exception here means nothing was committed."""
        last = self.started
        async for ev in self.gen:
            now = time.perf_counter()
            (metrics.INTER_TOKEN_LATENCY if self.tokens else metrics.TIME_TO_FIRST_TOKEN).observe(now - last)
            last = now
            metrics.GENERATION_TOKENS.inc()
            self.tokens.append(ev)
            yield ev
        res = self.gen.result
        assert res is not None
        self.meta = await commit(self.writer, self.engine, res.commit)
        metrics.E2E_REQUEST_LATENCY.observe(time.perf_counter() - self.started)
        metrics.REQUESTS_FINISHED.labels(res.finish_reason).inc()

    async def complete(self, request: Request) -> SessionMeta:
        """Run to the commit without streaming; a client that hangs up first abandons the
        generation, so nothing is committed (499 in the log)."""

        async def drain() -> None:
            async for _ in self.stream():
                pass

        work = asyncio.ensure_future(drain())
        watcher = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                raise ApiError(
                    ErrorType.client_disconnected, "the client disconnected; nothing was committed"
                )
            work.result()
        finally:
            work.cancel()
            watcher.cancel()
            await self.close()
        assert self.meta is not None
        return self.meta

    @property
    def finish_reason(self) -> str:
        assert self.gen.result is not None
        return self.gen.result.finish_reason

    @property
    def text(self) -> str:
        assert self.gen.result is not None
        return self.gen.result.text

    async def close(self) -> None:
        """Stop the generation (if still running) and release the lock (if not committed)."""
        self.gen.cancel()
        await self.writer.release()


async def start(
    engine: Engine,
    store: SessionStore,
    settings: Settings,
    session_id: str,
    *,
    ids: list[int],
    params: SamplingParams,
    seed: int | None,
    max_tokens: int,
    stop: list[str],
    expected: int | None,
    owner: str,
    started: float | None = None,
) -> Run:
    """Take the session's writer lock and start generating; the caller owns the `Run`."""
    started = time.perf_counter() if started is None else started
    writer, source = await begin(engine, store, session_id, expected, owner)
    try:
        gen = engine.generate(
            source,
            ids,
            params,
            seed=seed,
            max_tokens=min(max_tokens, settings.max_tokens),
            stop=stop,
        )
    except BaseException:
        await writer.release()
        raise
    return Run(engine, gen, writer, len(ids), started)
