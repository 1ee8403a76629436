"""Per-request plumbing around every route: the request id, the access log line and the
HTTP metrics.

A pure ASGI middleware (not BaseHTTPMiddleware), so streaming responses and the routes'
own disconnect detection pass through untouched. The request id is the client's
`X-Request-Id` when it is a sane token, else a new one; it is echoed in the response
header and set in `app.logs.request_id` for every log line of the request.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import logs, metrics

log = logging.getLogger("recur.access")
_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


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
        status = 500  # if the app raises before answering, ServerErrorMiddleware answers 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                message["headers"] = [*message.get("headers", []), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            route = scope.get("route")
            # the route template, never the raw path: session ids must not become label values
            template = getattr(route, "path", None) or "unmatched"
            method = scope["method"]
            elapsed = time.perf_counter() - started
            metrics.HTTP_REQUESTS.labels(method, template, str(status)).inc()
            metrics.HTTP_REQUEST_DURATION.labels(method, template).observe(elapsed)
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
