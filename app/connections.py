"""The HTTP connections one replica holds: how many, how many from one address, and how long
a connection may take to send a request's head.

uvicorn alone bounds none of it. Its `limit_concurrency` is checked only once a request's
head is complete, so a client that never finishes one (slowloris) is never counted, and
past the limit it answers everyone 503, the attacker's victims too; its
`timeout_keep_alive` starts only after a response, and any byte that arrives stops it. So
one address, without a key, held 20,000 connections that each trickled a header byte now
and then, and took every file descriptor the process had (issue 39).

`GuardedH11Protocol` is uvicorn's h11 protocol with three checks added, at the two moments
that cost nothing to check: when a connection is accepted (the process's count and the
peer address's count: past either, a `429 queue_full` answer and the connection closed at
once, its descriptor freed) and while a request's head is awaited (a deadline,
`header_timeout`, armed when the connection opens and after each response, and cut only
by a complete head: a trickle of bytes does not renew it).

Refusals and cut connections are logged as a count at most every `LOG_EVERY` seconds,
never a line each: an attack must not fill the disk with its own story.

It never reads a request or touches the app: uvicorn parses, the app answers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from app.api.http.error_types import ErrorType
from app.config import Settings

log = logging.getLogger("recur.connections")

LOG_EVERY = 10.0  # seconds between two log lines about refused or cut connections
# descriptors kept free of HTTP connections: Redis connections, the model's files, logs
RESERVED_FILES = 256


@dataclass
class ConnectionGuard:
    """The counts one process shares across its connections (the event loop's thread only)."""

    max_connections: int
    per_address: int  # 0: no per-address limit (behind a proxy, every client is the proxy)
    header_timeout: float
    open: int = 0
    by_address: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)  # since the last log line, by reason
    last_logged: float = 0.0

    def admit(self, address: str) -> str | None:
        """Count a new connection from `address` in, or say why it is refused."""
        if self.open >= self.max_connections:
            return self._refuse(
                "server", f"this server holds the most connections it takes ({self.max_connections})"
            )
        if self.per_address and self.by_address[address] >= self.per_address:
            return self._refuse(
                "address", f"your address holds the most connections one address may ({self.per_address})"
            )
        self.open += 1
        self.by_address[address] += 1
        return None

    def release(self, address: str) -> None:
        self.open -= 1
        self.by_address[address] -= 1
        if not self.by_address[address]:
            del self.by_address[address]

    def head_too_slow(self) -> None:
        self._count("head_timeout")

    def _refuse(self, reason: str, message: str) -> str:
        self._count(reason)
        return message

    def _count(self, reason: str) -> None:
        self.refused[reason] += 1
        now = time.monotonic()
        if now - self.last_logged >= LOG_EVERY:
            log.warning(
                "connections refused or cut since the last such line: %s (%d open, %d addresses)",
                ", ".join(f"{n} {_REASONS[r]}" for r, n in sorted(self.refused.items())),
                self.open,
                len(self.by_address),
                extra={"refused": dict(self.refused)},
            )
            self.refused.clear()
            self.last_logged = now


_REASONS = {
    "server": "past the server's connection limit",
    "address": "past the per-address limit",
    "head_timeout": "cut for not sending a request head in time",
}


def _refusal(message: str) -> bytes:
    body = json.dumps({"error": {"type": ErrorType.queue_full.value, "message": message}}).encode()
    head = (
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, its connections counted and its request heads timed."""

    guard: ConnectionGuard  # set by `protocol()` on a subclass of its own

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._address = self.client[0] if self.client else ""
        self._head_deadline: asyncio.TimerHandle | None = None
        refusal = self.guard.admit(self._address)
        self._admitted = refusal is None
        if refusal is not None:
            transport.write(_refusal(refusal))
            transport.close()
            return
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._admitted:
            self._admitted = False
            self.guard.release(self._address)
        self._stop_waiting()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a whole head arrived (or the peer erred)
            self._stop_waiting()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._await_head()  # the next request's head has the same time, however it trickles

    def _await_head(self) -> None:
        self._stop_waiting()
        self._head_deadline = self.loop.call_later(self.guard.header_timeout, self._head_timed_out)

    def _stop_waiting(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.guard.head_too_slow()
            self.transport.close()


def open_file_limit() -> int:
    """The process's open-file limit, raised to its hard limit first (what the OS allows
    without privileges): the soft limit is often 1,024, far below what a server needs."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def protocol(settings: Settings) -> type[GuardedH11Protocol]:
    """The protocol class for `uvicorn.run(http=...)`, with a guard of its own. The limit on
    connections stays `RESERVED_FILES` below the open-file limit, so that accepting never
    fails for want of a descriptor (each failure asyncio logs, with its traceback)."""
    max_connections = settings.max_connections
    headroom = open_file_limit() - RESERVED_FILES
    if max_connections > headroom:
        log.warning(
            "max_connections %d is more than the open-file limit leaves room for: %d",
            max_connections,
            headroom,
        )
        max_connections = max(1, headroom)
    guard = ConnectionGuard(max_connections, settings.max_connections_per_address, settings.header_timeout)
    attrs: dict[str, Any] = {"guard": guard}
    return type("GuardedH11Protocol", (GuardedH11Protocol,), attrs)
