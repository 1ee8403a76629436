"""The ASGI middleware around every route, outermost first.

`RequestContext`: per-request plumbing, the request id, the access log line and the HTTP
metrics, and the 500 answer to an exception no handler took (the connection stays usable). The request id is the client's `X-Request-Id` when it is a sane token, else a new
one; it is echoed in the response header and set in `app.logs.request_id` for every log
line of the request.

`BodyLimit`: a request body over `Settings.max_body_bytes` gets 413, before it is read in
full. A few routes take larger bodies (a state import, up to `Settings.max_import_mb`, by
default sized by the served model): their own limits, by path. A declared `Content-Length` over the limit is refused before the
app runs; a chunked body is counted as it arrives and refused as soon as it passes the
limit. The 413 carries `Connection: close`, so the server stops reading the rest.

`BrowserGuard`: what keeps a web page the user visits from using a server that is not
its own (the server on a laptop, open without keys, is the target). The `Host` a request
names must be one of `Settings.allowed_hosts` (DNS rebinding makes a page's own name
resolve to 127.0.0.1: its requests then name that page's host). A request that changes
state (POST, PUT, PATCH, DELETE, and the GET form of a session's generate, which commits)
must not come from another site: its `Origin`, when a browser sends one, must name the
request's own host, and its `Sec-Fetch-Site` must not say `cross-site`; and a body of a type a page may send
cross-site without asking (text/plain, a form) is refused, since every such route takes
JSON (or, an import, application/octet-stream).

All three are pure ASGI middleware (not BaseHTTPMiddleware): none buffers a body, and
streaming responses and the routes' own disconnect detection pass through untouched.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable
from urllib.parse import urlsplit

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import logs, metrics

from . import errors
from .errors import ErrorType, response

log = logging.getLogger("recur.access")
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# the methods HTTP defines (RFC 9110): any other name a client sends is one label, `other`,
# so that no client can add label values (each one a series kept for the process's life)
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})


class RequestContext:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _REQUEST_ID_RE.fullmatch(given) else uuid.uuid4().hex
        logs.request_id.set(rid)
        logs.session_id.set(None)
        status = 0  # until the response starts

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:
            if status:  # a response under way cannot be finished: the connection must close
                raise
            # answered here, not re-raised: Starlette's ServerErrorMiddleware would answer too,
            # then re-raise, and uvicorn drops a connection whose app raised: the client's next
            # request on it would fail (reset) for this one's error
            await errors.unexpected(exc)(scope, receive, send_with_id)
        finally:
            status = status or 500  # (cancelled, say: ServerErrorMiddleware answers, if anyone)
            route = scope.get("route")
            # the route template, never the raw path: session ids must not become label values
            template = getattr(route, "path", None) or "unmatched"
            method = logs.clip(scope["method"], 32)
            label = method if method in _METHODS else "other"
            elapsed = time.perf_counter() - started
            metrics.HTTP_REQUESTS.labels(label, template, str(status)).inc()
            metrics.HTTP_REQUEST_DURATION.labels(label, template).observe(elapsed)
            path = logs.clip(scope["path"], 200)
            log.info(
                "%s %s %d",
                method,
                path,
                status,
                extra={
                    "method": method,
                    "path": path,  # the query string is left out: it may hold an access_token
                    "route": template,
                    "status": status,
                    "duration_ms": round(elapsed * 1000, 2),
                    "client": (scope.get("client") or ("", 0))[0],
                },
            )


class BrowserGuard:
    def __init__(self, app: ASGIApp, allowed_hosts: str):
        self.app = app
        names = {h.strip().lower().strip("[]") for h in allowed_hosts.split(",") if h.strip()}
        self.any_host = "*" in names
        self.allowed = names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self._refusal(scope) if scope["type"] == "http" else None
        if refusal is None:
            await self.app(scope, receive, send)
            return
        await response(*refusal)(scope, receive, send)

    def _refusal(self, scope: Scope) -> tuple[ErrorType, str] | None:
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        name = _hostname(host)
        if not self.any_host and name not in self.allowed:
            return ErrorType.forbidden, (
                f"this server does not answer to the host {logs.clip(host, 80)!r}: add it to allowed_hosts "
                "(RECUR_ALLOWED_HOSTS) if it is this server's name"
            )
        committing_get = scope["method"] == "GET" and _COMMITTING_GET.fullmatch(scope["path"]) is not None
        if scope["method"] not in _CHANGES_STATE and not committing_get:
            return None
        origin = headers.get(b"origin")
        if origin is not None and _hostname(urlsplit(origin.decode("latin-1")).netloc) != name:
            return ErrorType.forbidden, (
                f"a request from another site ({logs.clip(origin.decode('latin-1'), 80)}) may not change state here"
            )
        if headers.get(b"sec-fetch-site") == b"cross-site":  # (a browser that sent no Origin)
            return ErrorType.forbidden, "a request from another site may not change state here"
        if committing_get:
            return None
        ctype = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
        if ctype in _SIMPLE_TYPES:
            wanted = (
                "application/octet-stream" if scope["path"] == "/v1/sessions/import" else "application/json"
            )
            return ErrorType.invalid_request, (
                f"the body must be sent with Content-Type: {wanted} (not {ctype!r}, which any web page may send)"
            )
        return None


_CHANGES_STATE = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# the GET form of a session's generate (for EventSource, which can only GET) commits too
_COMMITTING_GET = re.compile(r"/v1/sessions/[^/]+/generate")
# the bodies a browser sends cross-site without a CORS preflight (the "simple" types)
_SIMPLE_TYPES = frozenset({"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"})


def _hostname(netloc: str) -> str:
    """The host of `host[:port]` (IPv6 in brackets), lowercased, without the port."""
    netloc = netloc.strip().lower()
    if netloc.startswith("["):
        return netloc[1:].partition("]")[0]
    return netloc.rpartition(":")[0] if netloc.count(":") == 1 else netloc


class BodyTooLarge(HTTPException):
    """Raised from `receive` mid-body; the error handlers turn it into the 413 body."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than this server accepts ({limit} bytes)")
        self.headers = {"Connection": "close"}


class BodyLimit:
    def __init__(
        self, app: ASGIApp, max_bytes: int, by_path: dict[str, int | Callable[[], int]] | None = None
    ):
        self.app = app
        self.max_bytes = max_bytes
        self.by_path = by_path or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.by_path.get(scope["path"], self.max_bytes)
        if callable(limit):  # (a limit known only once the app has started)
            limit = limit()
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            err = BodyTooLarge(limit)
            await response(ErrorType.body_too_large, str(err.detail), err.headers)(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, counted, send)
