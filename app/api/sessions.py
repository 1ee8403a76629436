"""The session resource: create, read, delete, fork, generate (SSE or JSON), score.

Routers validate, translate to engine calls, and commit through the store; they never
touch tensors and never build error bodies (see errors.py). Every mutating route holds
the session's writer lock from start to commit, and commits fenced on the version it
started from, so a failed, cancelled or disconnected request changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from datetime import datetime, timezone
from typing import Annotated

from fastapi import APIRouter, Body, Request, Response
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.background import BackgroundTask

from app.engine import Engine, Generation, TokenEvent
from app.store import SessionMeta, Writer
from model.sampling import SamplingParams

from . import errors
from .deps import EngineDep, IfMatchDep, SettingsDep, StoreDep
from .errors import ApiError, ErrorType, responses
from .schemas import (
    CreateSession,
    Generate,
    GenerateDone,
    GeneratedToken,
    GenerateResult,
    Score,
    ScoredToken,
    ScoreResult,
    SessionDetail,
    SessionInfo,
    SessionRef,
    Usage,
)

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])

E = ErrorType
_SESSION_ERRORS = (E.session_not_found, E.redis_unavailable, E.invalid_request)
_WRITE_ERRORS = (*_SESSION_ERRORS, E.session_busy, E.version_mismatch, E.model_mismatch, E.invalid_request)


# -- translation helpers ----------------------------------------------------------------------
def _time(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=timezone.utc)


def _ref(meta: SessionMeta) -> SessionRef:
    return SessionRef(id=meta.id, version=meta.version, n_tokens=meta.n_tokens)


def _info(meta: SessionMeta) -> SessionInfo:
    return SessionInfo(
        id=meta.id,
        version=meta.version,
        n_tokens=meta.n_tokens,
        model=meta.model,
        created_at=_time(meta.created_at),
        expires_at=_time(meta.expires_at),
    )


def _etag(meta: SessionMeta) -> dict[str, str]:
    return {"ETag": f'"{meta.version}"'}


def _prompt_ids(engine: Engine, max_prompt_tokens: int, prompt: str | list[int]) -> list[int]:
    ids = engine.tokenize(prompt)
    if len(ids) > max_prompt_tokens:
        raise ApiError(
            E.prompt_too_long,
            f"prompt has {len(ids)} tokens; this server accepts at most {max_prompt_tokens}",
        )
    bad = [i for i in ids if not 0 <= i < engine.vocab_size]
    if bad:
        raise ApiError(
            E.invalid_request, f"token id {bad[0]} is outside the model's vocabulary [0, {engine.vocab_size})"
        )
    return ids


def _check_model(meta: SessionMeta, engine: Engine) -> None:
    if meta.fingerprint != engine.fingerprint:
        raise ApiError(
            E.model_mismatch,
            f"session {meta.id} belongs to model {meta.model!r} ({meta.fingerprint}); "
            f"this server runs {engine.name!r} ({engine.fingerprint})",
        )


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# -- routes ------------------------------------------------------------------------------------
@router.post(
    "",
    status_code=201,
    response_model=SessionInfo,
    summary="Create a session (BOS and the optional prompt consumed)",
    responses=responses(E.prompt_too_long, E.invalid_request, E.redis_unavailable),
)
async def create_session(
    response: Response,
    engine: EngineDep,
    store: StoreDep,
    settings: SettingsDep,
    body: Annotated[CreateSession | None, Body()] = None,
) -> SessionInfo:
    body = body or CreateSession.model_validate({})
    ttl = body.ttl_seconds or settings.session_ttl
    if ttl > settings.max_session_ttl:
        raise ApiError(E.invalid_request, f"ttl_seconds may be at most {settings.max_session_ttl}")
    ids = _prompt_ids(engine, settings.max_prompt_tokens, body.prompt)
    await store.ping()  # fail fast, before spending model time, when Redis is down
    consumed = await engine.new_session(ids)
    assert consumed.state is not None
    meta = await store.create(consumed.state, consumed.n_tokens, engine.name, engine.fingerprint, ttl)
    response.headers.update(_etag(meta))
    response.headers["Location"] = f"/v1/sessions/{meta.id}"
    return _info(meta)


@router.get(
    "/{session_id}",
    response_model=SessionDetail,
    summary="Read a session's metadata (ETag = version)",
    responses=responses(*_SESSION_ERRORS),
)
async def get_session(session_id: str, response: Response, store: StoreDep) -> SessionDetail:
    meta, _ = await store.read(session_id)
    response.headers.update(_etag(meta))
    return SessionDetail(**_info(meta).model_dump(), state_bytes=meta.state_bytes)


@router.delete(
    "/{session_id}",
    status_code=204,
    summary="Delete a session",
    responses=responses(*_SESSION_ERRORS, E.session_busy, E.version_mismatch, E.invalid_request),
)
async def delete_session(session_id: str, store: StoreDep, expected: IfMatchDep) -> Response:
    await store.delete(session_id, expected)
    return Response(status_code=204)


@router.post(
    "/{session_id}/fork",
    status_code=201,
    response_model=SessionInfo,
    summary="Copy a session's committed state into a new, independent session",
    responses=responses(*_SESSION_ERRORS, E.version_mismatch, E.invalid_request),
)
async def fork_session(
    session_id: str, response: Response, store: StoreDep, expected: IfMatchDep
) -> SessionInfo:
    meta = await store.fork(session_id, expected)
    response.headers.update(_etag(meta))
    response.headers["Location"] = f"/v1/sessions/{meta.id}"
    return _info(meta)


@router.post(
    "/{session_id}/score",
    response_model=ScoreResult,
    summary="Teacher-forced log-probs of the given tokens, continuing the session",
    responses=responses(*_WRITE_ERRORS, E.prompt_too_long, E.session_conflict),
)
async def score(
    session_id: str,
    body: Score,
    engine: EngineDep,
    store: StoreDep,
    settings: SettingsDep,
    expected: IfMatchDep,
) -> ScoreResult:
    ids = _prompt_ids(engine, settings.max_prompt_tokens, body.prompt)
    if body.commit:
        async with store.writer(session_id, expected) as w:
            _check_model(w.meta, engine)
            consumed = await engine.score(w.state, ids, keep_state=True)
            assert consumed.state is not None
            meta = await w.commit(consumed.state, consumed.n_tokens)
    else:
        meta, blob = await store.read(session_id, with_state=True)
        if expected is not None and meta.version != expected:
            raise ApiError(
                E.version_mismatch, f"session {session_id!r} is at version {meta.version}, not {expected}"
            )
        _check_model(meta, engine)
        assert blob is not None
        consumed = await engine.score(blob, ids, keep_state=False)
    tokens = [
        ScoredToken(id=i, text=engine.tokenizer.token_text(i), logprob=lp)
        for i, lp in zip(ids, consumed.logprobs, strict=True)
    ]
    total = sum(lp for lp in consumed.logprobs if lp is not None)
    return ScoreResult(tokens=tokens, total_logprob=total, session=_ref(meta))


_SSE_DOC = {
    "content": {
        "text/event-stream": {
            "schema": {"type": "string"},
            "example": 'event: token\ndata: {"index": 0, "id": 84, "text": "T"}\n\n'
            'event: done\ndata: {"text": "T", "finish_reason": "length", ...}\n\n',
        }
    },
    "description": "stream=true: `token` events, then `done` (or `error`). "
    "stream=false: one JSON object (GenerateResult).",
}


@router.post(
    "/{session_id}/generate",
    response_model=GenerateResult,
    response_model_exclude_none=True,
    summary="Consume the prompt, then sample tokens (SSE stream or one JSON object)",
    responses={200: _SSE_DOC, **responses(*_WRITE_ERRORS, E.prompt_too_long, E.session_conflict)},
)
async def generate(
    session_id: str,
    body: Generate,
    request: Request,
    engine: EngineDep,
    store: StoreDep,
    settings: SettingsDep,
    expected: IfMatchDep,
) -> GenerateResult | EventSourceResponse:
    ids = _prompt_ids(engine, settings.max_prompt_tokens, body.prompt)
    try:
        params = SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p)
    except ValueError as exc:
        raise ApiError(E.invalid_request, str(exc)) from None
    writer = await store.begin(session_id, expected)
    try:
        _check_model(writer.meta, engine)
        gen = engine.generate(
            writer.state,
            ids,
            params,
            seed=body.seed,
            max_tokens=min(body.max_tokens, settings.max_tokens),
            stop=list(body.stop),
        )
    except BaseException:
        await writer.release()
        raise
    if body.stream:
        return EventSourceResponse(
            _stream(gen, writer, len(ids), body.logprobs),
            background=BackgroundTask(_abandon, gen, writer),
            ping=15,
        )
    # non-streaming: a client that hangs up abandons the generation, so nothing is committed
    collect = asyncio.ensure_future(_collect(gen))
    watcher = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({collect, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not collect.done():
            raise ApiError(E.client_disconnected, "the client disconnected; nothing was committed")
        events = collect.result()
        assert gen.result is not None
        meta = await writer.commit(gen.result.state, gen.result.n_tokens)
    finally:
        collect.cancel()
        watcher.cancel()
        await _abandon(gen, writer)
    tokens = [
        GeneratedToken(index=e.index, id=e.id, text=e.text, logprob=e.logprob if body.logprobs else None)
        for e in events
    ]
    return GenerateResult(**_done(gen, meta, len(ids)).model_dump(), tokens=tokens)


async def _collect(gen: Generation) -> list[TokenEvent]:
    return [ev async for ev in gen]


def _done(gen: Generation, meta: SessionMeta, prompt_tokens: int) -> GenerateDone:
    res = gen.result
    assert res is not None
    return GenerateDone(
        text=res.text,
        finish_reason=res.finish_reason,  # type: ignore[arg-type]
        usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=len(res.token_ids)),
        session=_ref(meta),
    )


async def _abandon(gen: Generation, writer: Writer) -> None:
    gen.cancel()
    await writer.release()


def _sse_json(data: dict) -> str:
    # ASCII-only JSON: generated text can hold characters (U+2028, U+0085, ...) that some
    # SSE clients take for line breaks; escaped, every event is one line of plain ASCII
    return json.dumps(data, ensure_ascii=True, separators=(",", ":"))


async def _stream(gen: Generation, writer: Writer, prompt_tokens: int, logprobs: bool):
    try:
        async for ev in gen:
            data = {"index": ev.index, "id": ev.id, "text": ev.text}
            if logprobs:
                data["logprob"] = ev.logprob
            yield ServerSentEvent(data=_sse_json(data), event="token")
        assert gen.result is not None
        meta = await writer.commit(gen.result.state, gen.result.n_tokens)
        yield ServerSentEvent(
            data=_sse_json(_done(gen, meta, prompt_tokens).model_dump(mode="json")), event="done"
        )
    except Exception as exc:  # after streaming began: an error event, and nothing committed
        etype, message = errors.classify(exc)
        yield ServerSentEvent(data=_sse_json(errors.body(etype, message)), event="error")
    finally:
        with contextlib.suppress(BaseException):
            await _abandon(gen, writer)
