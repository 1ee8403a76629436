"""The hot cache: recently used session states on the device, LRU within a byte budget.

It is only a shortcut: Redis holds the truth, a cached state is used only after Redis has
confirmed its commit id (random, never reused, unlike version numbers), and an entry is
replaced only after its session's commit succeeded, so it never holds an uncommitted
state.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple

from model import State


class Held(NamedTuple):
    """A cached state and the commit that wrote it."""

    version: int
    commit_id: str
    state: State


class HotCache:
    """Session states by id, least recently used first out, within `max_bytes`. Read and
    written from the event loop only, but sized from the metrics thread: every access
    takes the lock."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[Held, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_id: str) -> Held | None:
        """The cached state of a session, marking it recently used."""
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None:
                return None
            self._entries.move_to_end(session_id)
            return entry[0]

    def put(self, session_id: str, held: Held) -> None:
        size = held.state.nbytes()
        with self._lock:
            old = self._entries.pop(session_id, None)
            if old is not None:
                if old[0].version > held.version:  # keep the newer of two racing puts
                    self._entries[session_id] = old
                    return
                self._bytes -= old[1]
            if size > self.max_bytes:
                return
            self._entries[session_id] = (held, size)
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self._bytes -= evicted

    def drop(self, session_id: str) -> None:
        with self._lock:
            old = self._entries.pop(session_id, None)
            if old is not None:
                self._bytes -= old[1]
