"""Errors as values: the one place that maps every exception to its error type (the enum
in `error_types.py`), its HTTP status and the body `{"error": {"type", "message"}}`.

Routers raise (`ApiError`, or the store's and engine's own exceptions) and never build
error responses themselves; a streaming response turns the same mapping into an SSE
`error` event. No traceback ever reaches a client.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path

from app import logs
from app.engine import EmptyContext, EngineError, EngineStalled, NonFinite, QueueFull
from app.sessions import ClientDisconnected, ModelMismatch, NotContinuable, StateRejected
from app.store import (
    CommitConflict,
    ObjectNotFound,
    OutcomeUnknown,
    QuotaExceeded,
    SessionBusy,
    SessionNotFound,
    StorageFull,
    StoreUnavailable,
    VersionGone,
    VersionMismatch,
)
from model import ContextFull, StateError
from model.chat_template import ChatTemplateError
from model.grammar import GrammarError
from model.tool_calls import ToolError

from ..schemas import ErrorBody
from .error_types import ErrorType

log = logging.getLogger("recur.api")


STATUS: dict[ErrorType, int] = {
    ErrorType.invalid_request: 422,
    # (400, not 422: the body is valid JSON of the documented shape; what its schema or tools
    # say, data to the API, cannot be had)
    ErrorType.invalid_schema: 400,
    ErrorType.unauthorized: 401,
    ErrorType.forbidden: 403,  # a host this server does not answer to, or another site's request
    ErrorType.model_not_found: 404,
    ErrorType.no_chat_template: 400,  # the request is fine; the served checkpoint cannot chat
    ErrorType.not_found: 404,
    ErrorType.method_not_allowed: 405,
    ErrorType.session_not_found: 404,
    ErrorType.object_not_found: 404,
    ErrorType.unsupported: 400,
    ErrorType.session_busy: 409,
    ErrorType.session_conflict: 409,
    ErrorType.model_mismatch: 409,
    ErrorType.version_mismatch: 412,
    ErrorType.version_gone: 409,
    ErrorType.prompt_too_long: 413,
    ErrorType.body_too_large: 413,
    ErrorType.queue_full: 429,
    ErrorType.quota_exceeded: 429,
    ErrorType.storage_full: 507,
    ErrorType.state_corrupt: 500,
    ErrorType.invalid_state: 422,
    ErrorType.redis_unavailable: 503,
    ErrorType.outcome_unknown: 503,
    ErrorType.not_ready: 503,
    ErrorType.engine_stalled: 503,
    ErrorType.internal_error: 500,
    ErrorType.client_disconnected: 499,  # nginx's "client closed request": only ever seen in logs
}

# exceptions raised below the API layer, most specific first
_EXCEPTIONS: list[tuple[type[Exception], ErrorType]] = [
    (SessionNotFound, ErrorType.session_not_found),
    (ObjectNotFound, ErrorType.object_not_found),
    (NotContinuable, ErrorType.unsupported),
    (SessionBusy, ErrorType.session_busy),
    (VersionMismatch, ErrorType.version_mismatch),
    (VersionGone, ErrorType.version_gone),
    (CommitConflict, ErrorType.session_conflict),
    (OutcomeUnknown, ErrorType.outcome_unknown),  # (a StoreUnavailable: before it)
    (StoreUnavailable, ErrorType.redis_unavailable),
    (QuotaExceeded, ErrorType.quota_exceeded),
    (StorageFull, ErrorType.storage_full),
    (ModelMismatch, ErrorType.model_mismatch),
    (ClientDisconnected, ErrorType.client_disconnected),
    (StateRejected, ErrorType.invalid_state),
    (NonFinite, ErrorType.invalid_state),  # a session whose (imported) state the model cannot continue
    (StateError, ErrorType.state_corrupt),
    (EmptyContext, ErrorType.invalid_request),
    (ContextFull, ErrorType.prompt_too_long),  # past the tokens the model keeps (exact attention)
    (ChatTemplateError, ErrorType.invalid_request),  # the template refused the conversation
    (GrammarError, ErrorType.invalid_schema),  # a JSON schema or tools' parameters that do not compile
    (ToolError, ErrorType.invalid_schema),  # tools no grammar can be made of
    (QueueFull, ErrorType.queue_full),
    (EngineStalled, ErrorType.engine_stalled),
    (EngineError, ErrorType.internal_error),
]


class ApiError(Exception):
    def __init__(self, type: ErrorType, message: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.type = type
        self.message = message
        self.headers = headers


def classify(exc: BaseException) -> tuple[ErrorType, str]:
    """The error type and client-facing message for any exception."""
    if isinstance(exc, ApiError):
        return exc.type, exc.message
    for cls, etype in _EXCEPTIONS:
        if isinstance(exc, cls):
            return etype, str(exc)
    log.error("unexpected error", exc_info=exc)
    return ErrorType.internal_error, f"internal error ({type(exc).__name__}); see the server log"


def body(etype: ErrorType, message: str) -> dict:
    return {"error": {"type": etype.value, "message": message}}


# seconds a client should wait before retrying, for the error types that say "try later"
RETRY_AFTER = {
    ErrorType.queue_full: 1,
    ErrorType.redis_unavailable: 1,
    ErrorType.outcome_unknown: 1,  # (by then, a write a stalled Redis had queued has run)
    ErrorType.not_ready: 5,
    ErrorType.engine_stalled: 5,
    ErrorType.storage_full: 30,
}


def error_headers(exc: BaseException) -> dict[str, str] | None:
    """Headers an error carries: its own (ApiError), or `Retry-After`: for a busy session the
    lock's remaining lease, rounded up (by then a dead holder's lock has lapsed); for a
    quota, when the tenant's rate would let it through."""
    if isinstance(exc, ApiError):
        return dict(exc.headers or {})
    if isinstance(exc, (SessionBusy, QuotaExceeded)):
        return {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
    return None


def response(etype: ErrorType, message: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if etype in RETRY_AFTER:
        headers.setdefault("Retry-After", str(RETRY_AFTER[etype]))
    return JSONResponse(body(etype, message), status_code=STATUS[etype], headers=headers)


# the error types whose responses carry Retry-After (RETRY_AFTER's, and error_headers's)
_RETRIES = {*RETRY_AFTER, ErrorType.session_busy, ErrorType.quota_exceeded}
_ERROR_BODY = f"#/components/schemas/{ErrorBody.__name__}"


def error_docs(*types: ErrorType) -> dict[int | str, dict]:
    """OpenAPI `responses=` entries for the error types a route raises itself. (What every
    route can answer, from the framework and the dependencies around it, app/api/http/openapi.py
    adds to each operation.)"""
    out: dict[int | str, dict] = {}
    document(out, types)
    return out


def document(responses: dict, types: Iterable[ErrorType]) -> None:
    """Add `types` to an operation's OpenAPI responses, merged with those already there: per
    status, the error body with its `type` narrowed to the types that status carries here.
    An entry not written by this function (FastAPI's own 422) is replaced."""
    by_status: dict[str, set[str]] = {}
    for t in types:
        if t is not ErrorType.client_disconnected:  # never reaches a client
            by_status.setdefault(str(STATUS[t]), set()).add(t.value)
    for status, names in by_status.items():
        old = responses.pop(int(status), None) or responses.pop(status, None) or {}
        names |= set(documented_types(old))
        responses[status] = _entry(sorted(names))


def documented_types(entry: dict) -> list[str]:
    """The error types an entry written by `document` lists ([] for any other entry)."""
    schema = entry.get("content", {}).get("application/json", {}).get("schema", {})
    if schema.get("$ref") != _ERROR_BODY:
        return []
    return list(schema["properties"]["error"]["properties"]["type"]["enum"])


def _entry(names: list[str]) -> dict:
    schema = {"$ref": _ERROR_BODY, "properties": {"error": {"properties": {"type": {"enum": names}}}}}
    entry: dict = {"description": ", ".join(names), "content": {"application/json": {"schema": schema}}}
    if any(ErrorType(n) in _RETRIES for n in names):
        entry["headers"] = {
            "Retry-After": {
                "description": "seconds to wait before retrying (quota, queue, busy session, storage, not ready)",
                "schema": {"type": "string", "pattern": "^[0-9]+$"},
            }
        }
    return entry


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    if any(err.get("type") == "json_invalid" for err in exc.errors()):
        return "invalid request: the body is not valid JSON"
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "invalid request: " + "; ".join(parts)


def documented_methods(request: Request) -> list[str]:
    """The methods the OpenAPI document lists for the request's path (the most specific
    template that matches it), for a 405's `Allow`: Starlette's own names only the methods of
    the first route that matched the path. None for a path the document does not list."""
    paths = request.app.openapi()["paths"]
    matching = [t for t in paths if compile_path(t)[0].match(request.url.path)]
    if not matching:
        return []
    template = min(matching, key=lambda t: t.count("{"))
    return sorted(m.upper() for m in paths[template])


def unexpected(exc: BaseException, id_header: bool = False) -> JSONResponse:
    """The answer to an exception no handler took: 500 naming the request id, which the log
    line of its traceback carries too (and, with `id_header`, in `X-Request-Id`: outside the
    RequestContext middleware, which adds it otherwise)."""
    etype, message = classify(exc)
    rid = logs.request_id.get()
    if rid is None:
        return response(etype, message)
    return response(
        etype, f"{message} (request id {rid})", headers={"X-Request-Id": rid} if id_header else None
    )


def install(app: FastAPI) -> None:
    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        etype, message = classify(exc)
        return response(etype, message, headers=error_headers(exc))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # (the last resort: RequestContext answers every exception a route raises itself)
        return unexpected(exc, id_header=True)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        ctype = request.headers.get("content-type", "")
        if "json" not in ctype and any(tuple(e.get("loc", ())) == ("body",) for e in exc.errors()):
            return response(
                ErrorType.invalid_request,
                f"the body must be JSON, sent with Content-Type: application/json (not {ctype or 'none'!r})",
            )
        return response(ErrorType.invalid_request, _validation_message(exc))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 400:  # FastAPI's "error parsing the body" (e.g. not UTF-8): 422, as bad JSON
            return response(
                ErrorType.invalid_request, f"invalid request: the body is not valid JSON ({exc.detail})"
            )
        etype = {
            404: ErrorType.not_found,
            405: ErrorType.method_not_allowed,
            413: ErrorType.body_too_large,
        }.get(exc.status_code)
        if etype is None:
            return JSONResponse(
                body(ErrorType.invalid_request, str(exc.detail)),
                status_code=exc.status_code,
                headers=exc.headers,
            )
        path = logs.clip(request.url.path, 120)
        headers = dict(exc.headers or {})
        if etype is ErrorType.method_not_allowed and (methods := documented_methods(request)):
            headers["Allow"] = ", ".join(methods)
        return response(etype, f"{request.method} {path}: {exc.detail}", headers=headers)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    handled: list[type[Exception]] = [ApiError, *(c for c, _ in _EXCEPTIONS)]
    for cls in handled:
        app.add_exception_handler(cls, on_error)
    app.add_exception_handler(Exception, on_unexpected)
