"""The session resource: create, read, delete, fork, generate (SSE or JSON), score, and
its history: the kept versions, rollback, the transcript (and the chat it holds, read
back by the served model's chat template), state export and import.

`GET .../generate` is the same generation for `EventSource` (which can only GET): its
parameters come in the query string, and it always streams.

Routers only translate HTTP: they parse and check bodies, call the sessions service
(app/sessions/, where each request's transaction runs from lock to commit), and frame
its results as JSON or SSE. They never touch tensors or Redis and never build error
bodies (see http/errors.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Annotated, Literal

from fastapi import APIRouter, Body, Depends, Query, Request, Response
from sse_starlette import EventSourceResponse, ServerSentEvent

from app.engine import Engine, Logprobs, TokenEvent
from app.sessions import Generation, Listed, Run
from app.store import SessionMeta
from app.tenants import LISTING_CURSOR
from app.transcript import conversation
from model.chat_template import ChatTemplate

from ..http.deps import (
    IfMatchDep,
    OwnerDep,
    ServicesDep,
    SessionsDep,
    SettingsDep,
    chat_template,
    prompt_ids,
    sampling_params,
)
from ..http.disconnect import HangupDep, until_disconnect
from ..http.errors import ApiError, ErrorType, error_docs
from ..http.sse import guarded, named_events, respond, sse_json, stream_response
from ..schemas import (
    CreateSession,
    ErrorBody,
    ForkAt,
    Generate,
    GenerateDone,
    GeneratedToken,
    GenerateQuery,
    GenerateResult,
    ListedSession,
    RollbackTo,
    Score,
    ScoredToken,
    ScoreResult,
    SessionDetail,
    SessionInfo,
    SessionList,
    SessionMessage,
    SessionMessages,
    SessionRef,
    TopLogprob,
    Transcript,
    TranscriptSegment,
    Usage,
    VersionInfo,
    VersionList,
)

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])  # auth: see create_app

# (the errors of the dependencies, auth and quotas among them, app/api/http/openapi.py adds)
_SESSION_ERRORS = (ErrorType.session_not_found, ErrorType.redis_unavailable, ErrorType.invalid_request)
_WRITE_ERRORS = (
    *_SESSION_ERRORS,
    ErrorType.outcome_unknown,  # a write Redis did not answer (docs/RELIABILITY.md, section 5)
    ErrorType.session_busy,
    ErrorType.version_mismatch,
    ErrorType.model_mismatch,
    ErrorType.invalid_request,
)
# every route that runs the model can find the scheduler's queue full or its engine stalled,
# or the session's state one the model cannot continue (non-finite, 422 invalid_state), and
# every one that stores a state can find Redis full
_MODEL_ERRORS = (
    ErrorType.prompt_too_long,
    ErrorType.queue_full,
    ErrorType.engine_stalled,
    ErrorType.storage_full,
    ErrorType.invalid_state,
)


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
    responses=error_docs(
        *_MODEL_ERRORS, ErrorType.invalid_request, ErrorType.redis_unavailable, ErrorType.outcome_unknown
    ),
)
async def create_session(
    response: Response,
    sessions: SessionsDep,
    settings: SettingsDep,
    owner: OwnerDep,
    hangup: HangupDep,
    body: Annotated[CreateSession | None, Body()] = None,
) -> SessionInfo:
    body = body or CreateSession.model_validate({})
    ttl = body.ttl_seconds or settings.session_ttl
    if ttl > settings.max_session_ttl:
        raise ApiError(ErrorType.invalid_request, f"ttl_seconds may be at most {settings.max_session_ttl}")
    if (body.keep_versions or 0) > settings.max_history_versions:
        raise ApiError(
            ErrorType.invalid_request, f"keep_versions may be at most {settings.max_history_versions}"
        )
    ids = prompt_ids(sessions.engine, settings.max_prompt_tokens, body.prompt)
    created = sessions.create(ids, ttl, owner, body.keep_versions)
    return _created(response, await hangup(created, unwatched=body.on_disconnect == "commit"))


@router.get(
    "",
    response_model=SessionList,
    summary="List the caller's own sessions, newest first, a page at a time",
    responses=error_docs(ErrorType.redis_unavailable, ErrorType.invalid_request),
)
async def list_sessions(
    services: ServicesDep,
    sessions: SessionsDep,
    owner: OwnerDep,
    limit: Annotated[int, Query(ge=1, le=1000, description="sessions per page, at most")] = 50,
    cursor: Annotated[
        str,
        Query(pattern=LISTING_CURSOR, description="`next_cursor` of the page before (`0`: the first page)"),
    ] = "0",
    ephemeral: Annotated[
        bool,
        Query(
            description="include the ephemeral sessions: those made for one request (a stateless "
            "completion's, an `n` choice's fork)"
        ),
    ] = False,
    model: Annotated[
        str | None,
        Query(
            max_length=256,
            description="only the sessions of this model (its name, as GET /v1/models lists it); a page "
            "may then hold fewer than `limit`, and `next_cursor` still says whether more follow",
        ),
    ] = None,
) -> SessionList:
    page = await sessions.listing(owner, "" if cursor == "0" else cursor, limit, ephemeral)
    preview = _Preview(sessions.engine, services.chat_template)
    return SessionList(
        sessions=[preview(s) for s in page.sessions if model is None or s.meta.model == model],
        next_cursor=page.cursor or None,
    )


# a listed session's preview: the start of what it consumed, at most this many characters
PREVIEW_CHARS = 80


@dataclass
class _Preview:
    """A listed session with its preview: a chat's first user message, else the start of
    its text; nothing for another model's session (this tokenizer would garble its ids)."""

    engine: Engine
    template: ChatTemplate | None

    def __call__(self, s: Listed) -> ListedSession:
        text = ""
        if s.meta.fingerprint == self.engine.fingerprint:
            tokenizer = self.engine.tokenizer
            text = tokenizer.decode(s.head[1:] if s.head[:1] == [tokenizer.bos_id] else s.head)
            first = self.template.first_user(text) if self.template is not None else None
            text = text if first is None else first.strip()
        return ListedSession(
            **_info(s.meta).model_dump(),
            ephemeral=s.ephemeral,
            preview=text if len(text) <= PREVIEW_CHARS else text[: PREVIEW_CHARS - 1] + "…",
        )


@router.post(
    "/import",
    status_code=201,
    response_model=SessionInfo,
    summary="Create a session from an exported state (the bytes of GET .../state)",
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
        }
    },
    responses=error_docs(
        ErrorType.invalid_state,
        ErrorType.invalid_request,
        ErrorType.body_too_large,
        ErrorType.redis_unavailable,
        ErrorType.outcome_unknown,
        ErrorType.storage_full,
        ErrorType.queue_full,
        ErrorType.engine_stalled,
        ErrorType.quota_exceeded,
    ),
)
async def import_session(
    request: Request,
    response: Response,
    sessions: SessionsDep,
    settings: SettingsDep,
    owner: OwnerDep,
    hangup: HangupDep,
    ttl_seconds: Annotated[int | None, Query(ge=1, description="idle seconds before it expires")] = None,
) -> SessionInfo:
    ttl = ttl_seconds or settings.session_ttl
    if ttl > settings.max_session_ttl:
        raise ApiError(ErrorType.invalid_request, f"ttl_seconds may be at most {settings.max_session_ttl}")
    # (a declared length past the import limit got 413 already, from the middleware)
    length = request.headers.get("content-length", "")
    declared = int(length) if length.isdigit() else None
    imported = sessions.import_state(hangup.body, declared, ttl, owner)
    return _created(response, await hangup(imported, reads_body=True))


@router.get(
    "/{session_id}/state",
    summary="Export the session's committed state (safetensors plus its JSON header; ETag = version)",
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
        **error_docs(
            *_SESSION_ERRORS,
            ErrorType.version_mismatch,
            ErrorType.version_gone,
            ErrorType.model_mismatch,
            ErrorType.queue_full,
            ErrorType.engine_stalled,
        ),
    },
)
async def export_state(
    session_id: str,
    sessions: SessionsDep,
    expected: IfMatchDep,
    owner: OwnerDep,
    dtype: Annotated[
        Literal["float32", "bfloat16", "float16"], Query(description="float dtype of the exported tensors")
    ] = "float32",
    version: Annotated[
        int | None, Query(ge=0, description="a kept past version (default: the current one)")
    ] = None,
) -> Response:
    meta, exported, blob = await sessions.export(session_id, owner, dtype, expected, version)
    headers = {
        "ETag": f'"{exported}"',
        "Content-Disposition": f'attachment; filename="{meta.id}.v{exported}.state"',
    }
    return Response(blob, media_type="application/octet-stream", headers=headers)


@router.get(
    "/{session_id}",
    response_model=SessionDetail,
    summary="Read a session's metadata (ETag = version)",
    responses=error_docs(*_SESSION_ERRORS),
)
async def get_session(
    session_id: str, response: Response, sessions: SessionsDep, owner: OwnerDep
) -> SessionDetail:
    meta = await sessions.get(session_id, owner)
    response.headers.update(_etag(meta))
    return SessionDetail(
        **_info(meta).model_dump(), state_bytes=meta.state_bytes, history_bytes=meta.history_bytes
    )


@router.delete(
    "/{session_id}",
    status_code=204,
    summary="Delete a session",
    responses=error_docs(
        *_SESSION_ERRORS, ErrorType.session_busy, ErrorType.version_mismatch, ErrorType.invalid_request
    ),
)
async def delete_session(
    session_id: str, sessions: SessionsDep, expected: IfMatchDep, owner: OwnerDep, hangup: HangupDep
) -> Response:
    await hangup(sessions.delete(session_id, expected, owner))
    return Response(status_code=204)


@router.post(
    "/{session_id}/fork",
    status_code=201,
    response_model=SessionInfo,
    summary="Copy a session's committed state (or a kept version's) into a new, independent session",
    responses=error_docs(
        *_SESSION_ERRORS,
        ErrorType.version_mismatch,
        ErrorType.version_gone,
        ErrorType.invalid_request,
        ErrorType.storage_full,
    ),
)
async def fork_session(
    session_id: str,
    response: Response,
    sessions: SessionsDep,
    expected: IfMatchDep,
    owner: OwnerDep,
    hangup: HangupDep,
    body: Annotated[ForkAt | None, Body()] = None,
) -> SessionInfo:
    version = body.version if body else None
    return _created(response, await hangup(sessions.fork(session_id, expected, owner, version)))


@router.post(
    "/{session_id}/rollback",
    response_model=SessionInfo,
    summary="Make a kept version's state current again, as a new version (undo, regenerate)",
    responses=error_docs(*_WRITE_ERRORS, *_MODEL_ERRORS, ErrorType.version_gone, ErrorType.session_conflict),
)
async def rollback(
    session_id: str,
    body: RollbackTo,
    response: Response,
    sessions: SessionsDep,
    expected: IfMatchDep,
    owner: OwnerDep,
    hangup: HangupDep,
) -> SessionInfo:
    meta = await hangup(sessions.rollback(session_id, body.version, expected, owner))
    response.headers.update(_etag(meta))
    return _info(meta)


@router.get(
    "/{session_id}/versions",
    response_model=VersionList,
    summary="The versions a session keeps: each can be forked, exported or rolled back to",
    responses=error_docs(*_SESSION_ERRORS),
)
async def versions(
    session_id: str, response: Response, sessions: SessionsDep, owner: OwnerDep
) -> VersionList:
    meta, kept = await sessions.versions(session_id, owner)
    response.headers.update(_etag(meta))
    return VersionList(
        session_id=meta.id,
        version=meta.version,
        versions=[
            VersionInfo(version=v.version, n_tokens=v.n_tokens, committed_at=_time(v.committed_at))
            for v in kept
        ],
    )


@router.get(
    "/{session_id}/transcript",
    response_model=Transcript,
    summary="The tokens the session's state consumed, commit by commit, with the action mask and "
    "behaviour log-probs",
    responses=error_docs(*_SESSION_ERRORS),
)
async def transcript(
    session_id: str,
    response: Response,
    sessions: SessionsDep,
    owner: OwnerDep,
    since_version: Annotated[
        int | None, Query(ge=0, description="only the session's own commits after this version")
    ] = None,
) -> Transcript:
    meta, segments, complete = await sessions.transcript(session_id, owner, since_version)
    response.headers.update(_etag(meta))
    return Transcript(
        session_id=meta.id,
        version=meta.version,
        n_tokens=meta.n_tokens,
        complete=complete,
        segments=[
            TranscriptSegment(**g.to_json(sessions.engine.tokenizer.stream_decoder())) for g in segments
        ],
    )


@router.get(
    "/{session_id}/messages",
    response_model=SessionMessages,
    summary="The chat the session holds: its messages, read back from its transcript by the served "
    "model's chat template",
    responses=error_docs(*_SESSION_ERRORS, ErrorType.no_chat_template, ErrorType.model_mismatch),
)
async def messages(
    session_id: str,
    response: Response,
    sessions: SessionsDep,
    owner: OwnerDep,
    template: Annotated[ChatTemplate, Depends(chat_template)],
) -> SessionMessages:
    meta, segments, complete = await sessions.transcript(session_id, owner)
    engine = sessions.engine
    if meta.fingerprint != engine.fingerprint:
        raise ApiError(
            ErrorType.model_mismatch,
            f"session {meta.id} belongs to model {meta.model!r}; this server runs {engine.name!r}, whose "
            "tokenizer and template cannot read it",
        )
    said, whole = conversation(segments, engine.tokenizer.decode, template, engine.tokenizer.bos_id)
    response.headers.update(_etag(meta))
    return SessionMessages(
        session_id=meta.id,
        version=meta.version,
        complete=complete and whole,
        messages=[SessionMessage(role=m.role, content=m.content, version=m.version) for m in said],
    )


@router.post(
    "/{session_id}/score",
    response_model=ScoreResult,
    summary="Teacher-forced log-probs of the given tokens, continuing the session",
    responses=error_docs(*_WRITE_ERRORS, *_MODEL_ERRORS, ErrorType.session_conflict),
)
async def score(
    session_id: str,
    body: Score,
    sessions: SessionsDep,
    settings: SettingsDep,
    expected: IfMatchDep,
    owner: OwnerDep,
    hangup: HangupDep,
) -> ScoreResult:
    engine = sessions.engine
    ids = prompt_ids(engine, settings.max_prompt_tokens, body.prompt)
    scored = sessions.score(session_id, ids, commit=body.commit, expected=expected, owner=owner)
    meta, logprobs = await hangup(scored, unwatched=body.on_disconnect == "commit")
    tokens = [
        ScoredToken(id=i, text=engine.tokenizer.token_text(i), logprob=lp)
        for i, lp in zip(ids, logprobs, strict=True)
    ]
    total = sum(lp for lp in logprobs if lp is not None)
    return ScoreResult(tokens=tokens, total_logprob=total, session=_ref(meta))


# `token` events (id: version.index), then `done` (id: version); `error` if it fails mid-stream
_EVENTS = named_events(
    {
        "token": (GeneratedToken, r"^[0-9]+\.[0-9]+$"),
        "done": (GenerateDone, r"^[0-9]+$"),
        "error": (ErrorBody, None),
    }
)
_SSE_DOC = stream_response(
    "stream=true: `token` events, then `done` (or `error`); stream=false: one JSON object", _EVENTS
)


@router.post(
    "/{session_id}/generate",
    response_model=GenerateResult,
    response_model_exclude_none=True,
    summary="Consume the prompt, then sample tokens (SSE stream or one JSON object)",
    responses={200: _SSE_DOC, **error_docs(*_WRITE_ERRORS, *_MODEL_ERRORS, ErrorType.session_conflict)},
)
async def generate(
    session_id: str,
    body: Generate,
    request: Request,
    services: ServicesDep,
    sessions: SessionsDep,
    settings: SettingsDep,
    expected: IfMatchDep,
    owner: OwnerDep,
) -> GenerateResult | EventSourceResponse:
    engine = sessions.engine
    ids = prompt_ids(engine, settings.max_prompt_tokens, body.prompt)
    max_tokens = min(body.max_tokens, settings.max_tokens)
    gen = Generation(
        sampling_params(body, engine, max_tokens),
        max_tokens,
        body.seed,
        list(body.stop),
        commit_on_disconnect=body.stream and body.on_disconnect == "commit",
        logprobs=Logprobs(top=body.top_logprobs),
    )
    async with services.tenants.starting(owner, 1, max_tokens) as admitted:
        run = await sessions.generate(session_id, ids, gen, expected=expected, owner=owner)
    admitted(run)
    token = _Token(engine.tokenizer.token_text, body.logprobs or body.top_logprobs > 0)
    if body.stream:
        frames = guarded(run, _events(run, token), error_event="error")
        return respond(run, frames, send_timeout=settings.stream_send_timeout)
    meta = await run.complete(until_disconnect(request))  # (as `hangup`, for a Run: app/sessions/run.py)
    return GenerateResult(**_done(run, meta).model_dump(), tokens=[token(e) for e in run.tokens])


@router.get(
    "/{session_id}/generate",
    summary="The streaming generate for EventSource: parameters in the query string",
    responses={
        200: stream_response("`token` events, then `done` (or `error`), as POST with stream=true", _EVENTS),
        **error_docs(*_WRITE_ERRORS, *_MODEL_ERRORS, ErrorType.session_conflict),
    },
)
async def generate_get(
    session_id: str,
    query: Annotated[GenerateQuery, Query()],
    request: Request,
    services: ServicesDep,
    sessions: SessionsDep,
    settings: SettingsDep,
    expected: IfMatchDep,
    owner: OwnerDep,
) -> EventSourceResponse:
    body = Generate(**query.model_dump(exclude={"access_token"}), stream=True)
    response = await generate(session_id, body, request, services, sessions, settings, expected, owner)
    assert isinstance(response, EventSourceResponse)
    return response


def _done(run: Run, meta: SessionMeta) -> GenerateDone:
    return GenerateDone(
        text=run.text,
        finish_reason=run.finish_reason,
        usage=Usage(prompt_tokens=run.prompt_tokens, completion_tokens=len(run.tokens)),
        session=_ref(meta),
    )


@dataclass(frozen=True)
class _Token:
    """A sampled token as the route shows it: with its log-prob and alternatives if asked."""

    token_text: Callable[[int], str]
    logprobs: bool

    def __call__(self, ev: TokenEvent) -> GeneratedToken:
        if not self.logprobs:
            return GeneratedToken(index=ev.index, id=ev.id, text=ev.text, logprob=None)
        top = [TopLogprob(id=i, text=self.token_text(i), logprob=lp) for i, lp in ev.top] if ev.top else None
        return GeneratedToken(index=ev.index, id=ev.id, text=ev.text, logprob=ev.logprob, top_logprobs=top)


async def _events(run: Run, token: _Token):
    """`token` events as they are sampled, then `done` once the new state is committed; each
    with an `id:` (version.index, then the version), so a client that lost the connection
    knows exactly which tokens it received."""
    async for ev in run.stream():
        data = token(ev).model_dump(mode="json", exclude_none=True)
        # the id names the version these tokens commit as, and the token's index in it
        yield ServerSentEvent(data=sse_json(data), event="token", id=f"{run.version}.{ev.index}")
    assert run.meta is not None
    done = _done(run, run.meta).model_dump(mode="json")
    yield ServerSentEvent(data=sse_json(done), event="done", id=str(run.meta.version))
