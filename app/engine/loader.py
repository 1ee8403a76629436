"""The loader thread: a request's stored starting state, parsed off the engine thread.

A SmolLM2 session's state is up to 47 MB. Parsed on the engine thread, one client importing
such states slowed another key's decoding 3.7×, and three of them 10.6× (issue 39): every
row of the shared batch waited for each parse. So the engine hands a request whose start is
`Stored` to this thread first. It reads the safetensors bytes and verifies them against the
model (`LanguageModel.read_state`, which runs no module, so it may run beside a step) and
against the count of tokens the session records; then it delivers the request, its start now
`Parsed`, to the engine thread, which only rebuilds the caches from the ready tensors. A full
queue refuses the request before any of this (`Scheduler.reserve`).

This thread never touches the scheduler's lines or the batch, and never runs a module.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from model import LanguageModel, StateError

from . import openmp
from .compiler import lower_priority
from .requests import Parsed, Request, Stored
from .runner import Counters


def backgrounded() -> None:
    """A thread pool's initializer: its thread gives way to the engine's on a busy core
    (`lower_priority`: nice 10, as the compile thread, a tenth of its weight). On a machine
    with as many cores as the engine has threads, a 47 MB parse or encoding on an equal
    footing took a core from the engine's step for its whole length. Its torch operations
    run on it alone (`openmp.step_aside`): a pool of OpenMP workers of its own would make
    the engine's workers sleep at every operation of a step."""
    lower_priority()
    openmp.step_aside()


def parse(lm: LanguageModel, stored: Stored) -> Parsed:
    """`stored`'s bytes as `lm`'s verified persistent tensors, or the error they met."""
    try:
        tensors = lm.read_state(stored.snapshot, stored.deltas)
        # a state that has consumed another number of tokens than its session records (say,
        # its deltas were lost) would silently fork the conversation: refuse it
        if int(tensors["n_tokens"][0]) != stored.n_tokens:
            raise StateError(
                f"the stored state has consumed {int(tensors['n_tokens'][0])} tokens, its session "
                f"records {stored.n_tokens}: its stored parts are inconsistent"
            )
        return Parsed(tensors)
    except Exception as exc:  # the engine thread fails the request with it
        return Parsed(None, exc)


class Loader:
    """One thread that parses stored starts in arrival order, then `deliver`s each request."""

    def __init__(self, lm: LanguageModel, deliver: Callable[[Request], None], counters: Counters):
        self.lm = lm
        self._deliver = deliver
        self.counters = counters  # (its parse_seconds: only this thread adds to it)
        self._pool = ThreadPoolExecutor(1, "recur-loader", initializer=backgrounded)

    def submit(self, req: Request) -> None:
        assert isinstance(req.start, Stored)
        self._pool.submit(self._parse, req)

    def _parse(self, req: Request) -> None:
        t0 = time.perf_counter()
        try:
            assert isinstance(req.start, Stored)
            req.start = parse(self.lm, req.start)
        finally:
            self.counters.parse_seconds += time.perf_counter() - t0
            self._deliver(req)

    def drain(self, timeout: float = 60) -> None:
        """Return once every request submitted so far has been parsed and delivered (one
        thread, in order): for a caller that takes the engine's steps itself."""
        self._pool.submit(lambda: None).result(timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
