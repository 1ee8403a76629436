"""Logging: one JSON object per line, carrying the current request's and session's ids.

The ids live in context variables: the request middleware sets `request_id`, the routes
set `session_id` once they know it, and every log record made while handling that
request (in the routes, the store, the error handler) carries them. Nothing here ever
logs a request body or an API key.
"""

from __future__ import annotations

import contextvars
import json
import logging
import time

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
session_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("session_id", default=None)


def clip(text: str, limit: int = 64) -> str:
    """Client-sent text (a session id, a path) as it may appear in a log line or an error
    message: whole when short, else its start and its length, so a 5,000-character garbage
    id is never echoed back or logged in full."""
    return text if len(text) <= limit else f"{text[: limit - 16]}…({len(text)} chars)"


# attributes every LogRecord has; anything else was passed with `extra=` and is logged as a field
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, var in (("request_id", request_id), ("session_id", session_id)):
            value = var.get()
            if value is not None:
                out[key] = value
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(levelname)s:     %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = [f"{k}={v.get()}" for k, v in (("request", request_id), ("session", session_id)) if v.get()]
        return f"{line} [{' '.join(ids)}]" if ids else line


def configure(level: str, fmt: str = "json") -> None:
    """Route every logger (uvicorn's included) through one stderr handler in `fmt`."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
