"""Logging: every log line carries the current request's and session's ids; it is plain
text for a person at a terminal and one JSON object per line for a log collector.

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
from typing import IO, Literal

LogFormat = Literal["auto", "json", "text"]

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
    """`2026-11-30 08:02:11.402 INFO  recur.access: POST /v1/sessions 201  request_id=… session_id=…`"""

    default_msec_format = "%s.%03d"

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-5s %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        # (the base class appends a traceback after this, so the ids stay on the message's line)
        line = super().formatMessage(record)
        pairs = (("request_id", request_id.get()), ("session_id", session_id.get()))
        ids = [f"{k}={v}" for k, v in pairs if v]
        return f"{line}  {' '.join(ids)}" if ids else line


def formatter(fmt: LogFormat, stream: IO[str]) -> logging.Formatter:
    """The formatter `fmt` names; `auto` is text when `stream` is a terminal (a person is
    reading), else JSON lines (a file, a pipe, a container's log collector)."""
    if fmt == "auto":
        fmt = "text" if stream.isatty() else "json"
    return TextFormatter() if fmt == "text" else JsonFormatter()


def configure(level: str, fmt: LogFormat = "auto") -> None:
    """Route every logger (uvicorn's included) through one stderr handler in `fmt`
    (`auto`: text if stderr is a terminal, else JSON lines)."""
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(fmt, handler.stream))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers[:] = []
        logger.propagate = True
