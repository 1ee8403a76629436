"""Giving freed host memory back to the operating system.

glibc's malloc keeps memory a process freed for reuse instead of returning it. A serving
process allocates working tensors whose sizes follow the batch (every decode step of a
16-row batch allocates and frees its own copies of the rows' states), so the freed chunks
of yesterday's largest batch stay resident, scattered between live ones, long after the
batch shrank: in the soak (`bench/soak.py`, docs/RELIABILITY.md) an idle replica kept
416-453 MiB resident without this and 323-337 MiB with it. `malloc_trim(0)` hands every
whole free page back (glibc >= 2.8 releases pages inside the heap too, not only its top)
and costs a few milliseconds here, so the engine thread calls it every few seconds
(`RECUR_MALLOC_TRIM_INTERVAL`) and once the process has gone quiet.

Elsewhere (musl, macOS, Windows) there is no such call and this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_TRIM = _malloc_trim()


class MallocTrimmer:
    """Calls malloc_trim at most every `interval` seconds (never when `interval` is 0)."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self.enabled = interval > 0 and _TRIM is not None
        self._clock = clock
        self._last = clock()
        self._dirty = False  # work ran since the last release
        self.releases = 0  # recur_malloc_trims_total
        self.seconds = 0.0  # spent in malloc_trim: recur_malloc_trim_seconds_total

    def worked(self) -> None:
        """Record that the engine ran something; release if the interval has passed."""
        self._dirty = True
        if self.enabled and self._clock() - self._last >= self.interval:
            self.release()

    @property
    def pending(self) -> bool:
        """Work ran since the last release (and releasing is on)."""
        return self.enabled and self._dirty

    def idle(self) -> None:
        """The process has gone quiet: release what the last burst freed."""
        if self.pending:
            self.release()

    def release(self) -> None:
        assert _TRIM is not None
        t0 = time.perf_counter()
        _TRIM(0)
        self.seconds += time.perf_counter() - t0
        self._last = self._clock()
        self._dirty = False
        self.releases += 1
