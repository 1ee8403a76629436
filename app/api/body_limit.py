"""BodyLimit: a request body over `Settings.max_body_bytes` gets 413, before it is read in full.
A few routes take larger bodies (a state import, up to `Settings.max_import_mb`): their
own limits, by path.

A declared `Content-Length` over the limit is refused before the app runs; a chunked body
is counted as it arrives and refused as soon as it passes the limit. The 413 carries
`Connection: close`, so the server stops reading the rest. A pure ASGI middleware: it
never buffers a body, and streaming responses pass through untouched.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import ErrorType, response


class BodyTooLarge(HTTPException):
    """Raised from `receive` mid-body; the error handlers turn it into the 413 body."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than this server accepts ({limit} bytes)")
        self.headers = {"Connection": "close"}


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, by_path: dict[str, int] | None = None):
        self.app = app
        self.max_bytes = max_bytes
        self.by_path = by_path or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.by_path.get(scope["path"], self.max_bytes)
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
