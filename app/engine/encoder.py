"""The encoder thread: a finished request's state turned into its commit bytes, off the
engine thread.

Encoding a state is a safetensors serialisation and a checksum over every byte: for a
SmolLM2 session's full state (47 MB), about 0.2 s. On the engine thread, every row of the
shared batch waited for it: beside three clients importing such states in a loop, another
key's first token took 9x its quiet p99 (issue 39), and half the engine thread's time went
to `State.to_bytes` and the finite check. So the engine thread only lets a done row leave
the batch with its own state (`Runner.finish`), and hands it here once the step's events
are out; this thread checks it finite, encodes it (`Encoder.seal`) and gives the outcome to
the request's event loop, after the request's last token. One thread, in order: a small
commit may wait behind a large one's encoding, but no step does.

This thread never touches the scheduler or the batch, and never runs a module.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from model import LanguageModel, State
from model.state import STORAGE_DTYPES, encode

from .loader import backgrounded
from .requests import Failed, Finished, NonFinite, Request, deliver
from .runner import Counters, Done


class Encoder:
    """One thread that seals done rows in the order they finished."""

    def __init__(self, lm: LanguageModel, counters: Counters):
        self.lm = lm
        self.counters = counters  # (its encode_seconds: only this thread adds to it)
        self._pool = ThreadPoolExecutor(1, "recur-encoder", initializer=backgrounded)

    def submit(self, req: Request, done: Done) -> None:
        self._pool.submit(self._run, req, done)

    def _run(self, req: Request, done: Done) -> None:
        try:
            event: Finished | Failed = self.seal(done)
        except Exception as exc:  # a non-finite state, a failed encoding: the request fails
            event = Failed.of(exc)
        deliver(req, event)

    def seal(self, done: Done) -> Finished:
        """The outcome of a finished row: checked finite, with the bytes its commit must
        write. It reads the row's own state, which no step touches any more, and runs no
        module."""
        r, state = done.row, done.state
        if not state.finite():
            raise NonFinite("this step made the session's state non-finite: it was not committed")
        encoded = None
        if r.req.persist is not None:
            t0 = time.perf_counter()
            encoded = encode(state, r.req.persist)
            state = self._as_stored(state, r.req.persist.dtype)
            self.counters.encode_seconds += time.perf_counter() - t0
        return Finished(
            r.text,
            r.finish_reason or "length",
            r.ids,
            r.prompt_logprobs,
            state,
            encoded,
            r.loaded,
            r.prompt_top,
        )

    def _as_stored(self, state: State, dtype: str) -> State:
        """`state` exactly as a replica that loads its stored bytes gets it: stored in a
        narrower dtype than it computes in (bfloat16, say), its float tensors are rounded
        through that dtype and its caches rebuilt from them. The session's next request
        then continues the same way whichever replica serves it, hot or from Redis."""
        stored = STORAGE_DTYPES[dtype]
        kept = {name: state.tensors[name] for name in state.persistent}
        if all(t.dtype == stored for t in kept.values() if t.is_floating_point()):
            return state
        return self.lm.rebuild_state(
            {name: t.to(stored).to(t.dtype) if t.is_floating_point() else t for name, t in kept.items()}
        )

    def drain(self, timeout: float = 60) -> None:
        """Return once every row submitted so far is sealed and its outcome handed over: for
        a caller that takes the engine's steps itself."""
        self._pool.submit(lambda: None).result(timeout)

    def close(self) -> None:
        """Seal what was handed over (their commits then land), then stop."""
        self._pool.shutdown(wait=True)
