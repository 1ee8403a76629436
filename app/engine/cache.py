"""The hot state cache: recently used session states kept on the device, LRU within a
byte budget.

A cached state is only a shortcut: Redis holds the truth. Before a request uses a cached
state, its commit id is confirmed against Redis in the same round trip that starts the
request (`SessionStore.begin/read(held_commit=...)`); if another replica has moved the
session on (or Redis lost the commit the cache holds), Redis returns the bytes and the
state is reloaded. Commit ids are random and never reused, unlike version numbers. An
entry is replaced only after its session's commit succeeded, so the cache never holds an
uncommitted state.

Entries are read by the event loop (which passes the opaque State on to the scheduler
thread, never touching its tensors) and written by both, so every access takes the lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple

from app import metrics
from model import State


class Held(NamedTuple):
    """A cached state and the commit that wrote it."""

    version: int
    commit_id: str
    state: State


class HotCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[Held, int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

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

    def count(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1
        (metrics.HOT_CACHE_HITS if hit else metrics.HOT_CACHE_MISSES).inc()

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
