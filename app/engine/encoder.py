"""The encoder thread: a finished request's state turned into its commit bytes, off the
engine thread.

Encoding a state is a safetensors serialisation and a checksum over every byte: for a
SmolLM2 session's full state (47 MB), about 0.2 s. On the engine thread, every row of the
shared batch waited for it: beside three clients importing such states in a loop, another
key's first token took 9x its quiet p99 (issue 39), and half the engine thread's time went
to `State.to_bytes` and the finite check. So the engine thread only lets a done row leave
the batch with its own state (`Runner.finish`), and hands it here once the step's events
are out; this thread checks it finite, encodes it (`Runner.seal`) and gives the outcome to
the request's event loop, after the request's last token.

This thread never touches the scheduler or the batch, and never runs a module.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from .requests import Failed, Finished, Request, deliver
from .runner import Done


class Encoder:
    """One thread that seals done rows in the order they finished."""

    def __init__(self, seal: Callable[[Done], Finished]):
        self._seal = seal
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recur-encoder")

    def submit(self, req: Request, done: Done) -> None:
        self._pool.submit(self._run, req, done)

    def _run(self, req: Request, done: Done) -> None:
        try:
            event: Finished | Failed = self._seal(done)
        except Exception as exc:  # a non-finite state, a failed encoding: the request fails
            event = Failed.of(exc)
        deliver(req, event)

    def drain(self, timeout: float = 60) -> None:
        """Return once every row submitted so far is sealed and its outcome handed over: for
        a caller that takes the engine's steps itself."""
        self._pool.submit(lambda: None).result(timeout)

    def close(self) -> None:
        """Seal what was handed over (their commits then land), then stop."""
        self._pool.shutdown(wait=True)
