"""The engine's watchdog: a step that runs past its deadline fails the requests in it.

A forward can hang (a driver fault, a pathological input, a lock that is never released)
and the engine thread cannot be interrupted, but the requests it holds can still be
answered. A watchdog thread looks at the step in progress (at least once a second); once
it has run `deadline` seconds, every request in it fails with `EngineStalled` and is
cancelled, so nothing of it is ever committed, and the engine reports itself stalled (not
ready, and new requests refused at once) until the step ends. Requests still waiting in
the queue are no business of the stalled step: when it ends, the engine serves them.

This module imports only the engine's own request types.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator

from .requests import EngineError, Failed, Request


class EngineStalled(EngineError):
    """The engine has been in one step past its deadline: the request failed, or was refused."""


class Watchdog:
    def __init__(self, deadline: float):
        self.deadline = deadline
        self._lock = threading.Lock()
        self._began: float | None = None  # when the step in progress began (None: between steps)
        self._requests: tuple[Request, ...] = ()
        self._fired = False
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="recur-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._closed.set()

    @property
    def stalled_for(self) -> float:
        """Seconds the step in progress has run past its deadline (0: none has)."""
        began = self._began
        return 0.0 if began is None else max(0.0, time.monotonic() - began - self.deadline)

    def check(self) -> None:
        """Raise EngineStalled while the engine is stalled (refusing a new request)."""
        late = self.stalled_for
        if late > 0:
            raise EngineStalled(
                f"the engine has been in one step for {late + self.deadline:.0f} s, past its deadline of "
                f"{self.deadline:g} s; retry shortly, or on another replica"
            )

    @contextlib.contextmanager
    def watching(self, requests: Iterable[Request]) -> Iterator[None]:
        """Around one engine step that serves `requests`."""
        with self._lock:
            self._began, self._requests, self._fired = time.monotonic(), tuple(requests), False
        try:
            yield
        finally:
            with self._lock:
                self._began, self._requests = None, ()

    def _watch(self) -> None:
        period = min(1.0, self.deadline / 4)
        while not self._closed.wait(period):
            with self._lock:
                if self._fired or self._began is None or time.monotonic() - self._began < self.deadline:
                    continue
                self._fired = True
                requests = self._requests
            error = EngineStalled(
                f"the engine step serving this request ran past its deadline of {self.deadline:g} s; "
                "nothing was committed"
            )
            for req in requests:
                _fail(req, error)


def _fail(req: Request, error: EngineError) -> None:
    """Fail `req` from this thread: its consumer sees the error as its next event."""
    req.cancel()
    with contextlib.suppress(RuntimeError):  # its loop has closed: nobody is listening
        req.loop.call_soon_threadsafe(req.events.put_nowait, Failed(error))
