"""The session resource: create, read, delete, fork, generate (SSE or JSON), score.

`GET .../generate` is the same generation for `EventSource` (which can only GET): its
parameters come in the query string, and it always streams.

Routers validate, translate to engine calls, and commit through the store; they never
touch tensors and never build error bodies (see errors.py). Every mutating route holds
the session's writer lock from start to commit, and commits fenced on the version it
started from, so a failed, cancelled or disconnected request changes nothing.
"""

from __future__ import annotations

import contextlib
import json
from datetime import datetime, timezone
from typing import Annotated

from fastapi import APIRouter, Body, Query, Request, Response
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.background import BackgroundTask

from app.store import SessionMeta

from . import errors, generation
from .deps import EngineDep, IfMatchDep, OwnerDep, SettingsDep, StoreDep
from .errors import ApiError, ErrorType, responses
from .generation import Run, begin, commit, prompt_ids, read, sampling_params, start
from .schemas import (
    CreateSession,
    Generate,
    GenerateDone,
    GeneratedToken,
    GenerateQuery,
    GenerateResult,
    Score,
    ScoredToken,
    ScoreResult,
    SessionDetail,
    SessionInfo,
    SessionRef,
    Usage,
)

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])  # auth: see create_app

E = ErrorType
_SESSION_ERRORS = (E.session_not_found, E.redis_unavailable, E.invalid_request, E.unauthorized)
_WRITE_ERRORS = (*_SESSION_ERRORS, E.session_busy, E.version_mismatch, E.model_mismatch, E.invalid_request)
# every route that runs the model can find the scheduler's queue full
_MODEL_ERRORS = (E.prompt_too_long, E.queue_full)


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


def _created(response: Response, meta: SessionMeta) -> SessionInfo:
    """A 201 body for a new session, with its ETag and Location."""
    response.headers.update(_etag(meta))
    response.headers["Location"] = f"/v1/sessions/{meta.id}"
    return _info(meta)


# -- routes ------------------------------------------------------------------------------------
@router.post(
    "",
    status_code=201,
    response_model=SessionInfo,
    summary="Create a session (BOS and the optional prompt consumed)",
    responses=responses(*_MODEL_ERRORS, E.invalid_request, E.redis_unavailable, E.unauthorized),
)
async def create_session(
    response: Response,
    engine: EngineDep,
    store: StoreDep,
    settings: SettingsDep,
    owner: OwnerDep,
    body: Annotated[CreateSession | None, Body()] = None,
) -> SessionInfo:
    body = body or CreateSession.model_validate({})
    ttl = body.ttl_seconds or settings.session_ttl
    if ttl > settings.max_session_ttl:
        raise ApiError(E.invalid_request, f"ttl_seconds may be at most {settings.max_session_ttl}")
    ids = prompt_ids(engine, settings.max_prompt_tokens, body.prompt)
    return _created(response, await generation.create_session(engine, store, ids, ttl, owner))


@router.get(
    "/{session_id}",
    response_model=SessionDetail,
    summary="Read a session's metadata (ETag = version)",
    responses=responses(*_SESSION_ERRORS),
)
async def get_session(session_id: str, response: Response, store: StoreDep, owner: OwnerDep) -> SessionDetail:
    meta, _ = await store.read(session_id, owner=owner)
    response.headers.update(_etag(meta))
    return SessionDetail(**_info(meta).model_dump(), state_bytes=meta.state_bytes)


@router.delete(
    "/{session_id}",
    status_code=204,
    summary="Delete a session",
    responses=responses(*_SESSION_ERRORS, E.session_busy, E.version_mismatch, E.invalid_request),
)
async def delete_session(
    session_id: str, store: StoreDep, engine: EngineDep, expected: IfMatchDep, owner: OwnerDep
) -> Response:
    await store.delete(session_id, expected, owner)
    engine.forget(session_id)
    return Response(status_code=204)


@router.post(
    "/{session_id}/fork",
    status_code=201,
    response_model=SessionInfo,
    summary="Copy a session's committed state into a new, independent session",
    responses=responses(*_SESSION_ERRORS, E.version_mismatch, E.invalid_request),
)
async def fork_session(
    session_id: str, response: Response, store: StoreDep, expected: IfMatchDep, owner: OwnerDep
) -> SessionInfo:
    return _created(response, await store.fork(session_id, expected, owner))


@router.post(
    "/{session_id}/score",
    response_model=ScoreResult,
    summary="Teacher-forced log-probs of the given tokens, continuing the session",
    responses=responses(*_WRITE_ERRORS, *_MODEL_ERRORS, E.session_conflict),
)
async def score(
    session_id: str,
    body: Score,
    engine: EngineDep,
    store: StoreDep,
    settings: SettingsDep,
    expected: IfMatchDep,
    owner: OwnerDep,
) -> ScoreResult:
    ids = prompt_ids(engine, settings.max_prompt_tokens, body.prompt)
    if body.commit:
        writer, source = await begin(engine, store, session_id, expected, owner)
        try:
            consumed = await engine.score(source, ids, keep_state=True)
            assert consumed.commit is not None
            meta = await commit(writer, engine, consumed.commit)
        finally:
            await writer.release()
    else:
        meta, source = await read(engine, store, session_id, expected, owner)
        consumed = await engine.score(source, ids, keep_state=False)
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
    responses={200: _SSE_DOC, **responses(*_WRITE_ERRORS, *_MODEL_ERRORS, E.session_conflict)},
)
async def generate(
    session_id: str,
    body: Generate,
    request: Request,
    engine: EngineDep,
    store: StoreDep,
    settings: SettingsDep,
    expected: IfMatchDep,
    owner: OwnerDep,
) -> GenerateResult | EventSourceResponse:
    ids = prompt_ids(engine, settings.max_prompt_tokens, body.prompt)
    run = await start(
        engine,
        store,
        settings,
        session_id,
        ids=ids,
        params=sampling_params(body.temperature, body.top_k, body.top_p),
        seed=body.seed,
        max_tokens=body.max_tokens,
        stop=list(body.stop),
        expected=expected,
        owner=owner,
    )
    if body.stream:
        return EventSourceResponse(_stream(run, body.logprobs), background=BackgroundTask(run.close), ping=15)
    meta = await run.complete(request)
    tokens = [
        GeneratedToken(index=e.index, id=e.id, text=e.text, logprob=e.logprob if body.logprobs else None)
        for e in run.tokens
    ]
    return GenerateResult(**_done(run, meta).model_dump(), tokens=tokens)


@router.get(
    "/{session_id}/generate",
    summary="The streaming generate for EventSource: parameters in the query string",
    responses={
        200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}, "description": "as POST"},
        **responses(*_WRITE_ERRORS, *_MODEL_ERRORS, E.session_conflict),
    },
)
async def generate_get(
    session_id: str,
    query: Annotated[GenerateQuery, Query()],
    request: Request,
    engine: EngineDep,
    store: StoreDep,
    settings: SettingsDep,
    expected: IfMatchDep,
    owner: OwnerDep,
) -> EventSourceResponse:
    body = Generate(**query.model_dump(exclude={"access_token"}), stream=True)
    response = await generate(session_id, body, request, engine, store, settings, expected, owner)
    assert isinstance(response, EventSourceResponse)
    return response


def _done(run: Run, meta: SessionMeta) -> GenerateDone:
    return GenerateDone(
        text=run.text,
        finish_reason=run.finish_reason,  # type: ignore[arg-type]
        usage=Usage(prompt_tokens=run.prompt_tokens, completion_tokens=len(run.tokens)),
        session=_ref(meta),
    )


def sse_json(data: dict) -> str:
    # ASCII-only JSON: generated text can hold characters (U+2028, U+0085, ...) that some
    # SSE clients take for line breaks; escaped, every event is one line of plain ASCII
    return json.dumps(data, ensure_ascii=True, separators=(",", ":"))


async def _stream(run: Run, logprobs: bool):
    try:
        async for ev in run.stream():
            data = {"index": ev.index, "id": ev.id, "text": ev.text}
            if logprobs:
                data["logprob"] = ev.logprob
            yield ServerSentEvent(data=sse_json(data), event="token")
        assert run.meta is not None
        yield ServerSentEvent(data=sse_json(_done(run, run.meta).model_dump(mode="json")), event="done")
    except Exception as exc:  # after streaming began: an error event, and nothing committed
        etype, message = errors.classify(exc)
        yield ServerSentEvent(data=sse_json(errors.body(etype, message)), event="error")
    finally:
        with contextlib.suppress(BaseException):
            await run.close()
