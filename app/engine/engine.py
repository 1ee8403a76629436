"""Engine: the API's asyncio-facing handle on the model, its scheduler, its tokenizer and
the hot state cache.

Every method that touches tensors runs on the scheduler thread (`Scheduler.call` or
`Scheduler.submit`); the coroutines here only await results. The engine speaks in token
ids, opaque states and state bytes, never in HTTP.

Persistence: a request that started from a stored state commits only what changed (a
state delta, `State.delta_bytes`) unless the deltas stored since the snapshot would then
outweigh the snapshot itself; then it writes a fresh snapshot, which also clears the
deltas. Bytes written per request therefore grow with the new tokens, and a full read
never merges more than about one snapshot's worth of deltas.
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator
from dataclasses import dataclass

import torch

from app.store import SessionMeta, StateBlobs
from model import LanguageModel, State, StateError
from model.sampling import SamplingParams
from model.tokenizer import Tokenizer

from .cache import Held, HotCache
from .requests import Commit, EngineError, Generation, StateSource
from .scheduler import Scheduler


def _owning(state: State) -> State:
    """`state`, or a copy whose tensors own exactly their memory. A row split off a batch
    (and a sliding window narrowed out of a longer tensor) is a view that keeps the whole
    storage alive while `nbytes()` counts only the view: kept in the hot cache, it would
    hold up to batch-size times its budget."""
    if all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in state.tensors.values()):
        return state
    return state.clone()


def _check_tokens(state: State, source: StateSource) -> None:
    """A stored state that has consumed another number of tokens than its session records
    (say, its deltas were lost) would silently fork the conversation: refuse it."""
    if int(state.n_tokens[0]) != source.n_tokens:
        raise StateError(
            f"the stored state has consumed {int(state.n_tokens[0])} tokens, its session records "
            f"{source.n_tokens}: its stored parts are inconsistent"
        )


@dataclass(frozen=True)
class Consumed:
    """The outcome of teacher-forcing tokens into a state."""

    logprobs: list[float | None]  # None where the state had no context at all
    commit: Commit | None  # the new state and what to write, when asked for
    n_tokens: int


class Engine:
    def __init__(
        self,
        lm: LanguageModel,
        *,
        name: str,
        state_dtype: str = "float32",
        max_batch_size: int = 32,
        max_queued_requests: int = 256,
        max_queued_tokens: int = 262_144,
        cpu_threads: int = 0,
        hot_cache_bytes: int = 256 * 2**20,
        delta_persistence: bool = True,
        compile: bool = False,
        malloc_trim_interval: float = 0.0,
    ):
        if cpu_threads:
            # tiny decode steps gain nothing from intra-op threads and lose a lot to contention
            torch.set_num_threads(cpu_threads)
        if lm.tokenizer is None:
            raise ValueError("the model has no tokenizer")
        self.lm = lm
        self.name = name
        self.tokenizer: Tokenizer = lm.tokenizer
        self.fingerprint = lm.fingerprint
        self.state_dtype = state_dtype
        self.delta_persistence = delta_persistence
        self.cache = HotCache(hot_cache_bytes)
        # seconds spent turning bytes into states and states into bytes (bench/persistence.py)
        self.timings = {"load_s": 0.0, "serialise_s": 0.0}
        decode = lm.forward
        if compile:
            # shapes change with the batch and the memory's fill level: dynamic, so they do
            # not each recompile; on CUDA, reduce-overhead replays the step as a CUDA graph
            mode = "reduce-overhead" if lm.device.type == "cuda" else "default"
            decode = torch.compile(lm.forward, dynamic=True, mode=mode)
            # a compiled step builds its state functionally: growing in place is Python-side
            # bookkeeping over buffers the step mutates, which breaks graphs and CUDA graphs
            lm.append_in_place = False
        self.scheduler = Scheduler(
            lm,
            decode=decode,
            load=self._load,
            commit=self._commit,
            max_batch_size=max_batch_size,
            max_queued_requests=max_queued_requests,
            max_queued_tokens=max_queued_tokens,
            malloc_trim_interval=malloc_trim_interval,
        )

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    # -- states: the hot cache and persistence (event loop side) --------------------------------
    def held(self, session_id: str) -> Held | None:
        """The state of `session_id` this replica holds on the device, if any. The caller
        keeps the reference, so a later eviction cannot take it away mid-request."""
        return self.cache.get(session_id)

    def source(self, meta: SessionMeta, blobs: StateBlobs | None, held: Held | None) -> StateSource:
        """The starting state of a request on `meta`: the bytes Redis returned or, when it
        returned none because `held` is the current commit, the held state."""
        cached = None
        if blobs is None:
            if held is None or held.commit_id != meta.commit_id:
                raise EngineError(f"session {meta.id}: Redis sent no state and the current one is not held")
            cached = held.state
        self.cache.count(hit=cached is not None)
        return StateSource(
            meta.id,
            meta.version,
            meta.commit_id,
            meta.n_tokens,
            blobs,
            cached,
            snapshot_bytes=meta.snapshot_bytes,
            delta_bytes=meta.delta_bytes,
        )

    def remember(self, meta: SessionMeta, commit: Commit) -> None:
        """Record a committed state as the hot copy of its session."""
        self.cache.put(meta.id, Held(meta.version, meta.commit_id, commit.state))

    def forget(self, session_id: str) -> None:
        self.cache.drop(session_id)

    # -- states (scheduler thread side) ----------------------------------------------------------
    def _load(self, source: StateSource) -> State:
        if source.cached is not None:
            state = source.cached
        else:
            assert source.blobs is not None
            t0 = time.perf_counter()
            state = _owning(self.lm.load_state(source.blobs.snapshot, source.blobs.deltas))
            self.timings["load_s"] += time.perf_counter() - t0
        _check_tokens(state, source)
        if source.cached is None and source.session_id is not None:  # (checked: never cache a damaged one)
            self.cache.put(source.session_id, Held(source.version, source.commit_id, state))
        return state

    def _commit(self, source: StateSource | None, state: State) -> Commit:
        t0 = time.perf_counter()
        try:
            # the committed state goes on to the hot cache: it must own its memory (see _owning)
            return self._serialise(source, _owning(state))
        finally:
            self.timings["serialise_s"] += time.perf_counter() - t0

    def _serialise(self, source: StateSource | None, state: State) -> Commit:
        n = int(state.n_tokens[0])
        if source is None or not self.delta_persistence or source.snapshot_bytes == 0:
            return Commit(n, state.to_bytes(self.state_dtype), None, state)
        delta = state.delta_bytes(since=source.n_tokens, dtype=self.state_dtype)
        if source.delta_bytes + len(delta) > source.snapshot_bytes:
            return Commit(n, state.to_bytes(self.state_dtype), None, state)
        return Commit(n, None, delta, state)

    def _chunks(self, ids: list[int]) -> list[list[int]]:
        n = self.lm.segment_len
        return [ids[i : i + n] for i in range(0, len(ids), n)]

    # -- requests --------------------------------------------------------------------------------
    async def new_session(self, prompt: list[int]) -> Consumed:
        """A fresh state with BOS (if the model has one) and `prompt` consumed."""

        def run() -> Generator[None, None, Consumed]:
            bos = self.tokenizer.bos_id
            ids = ([bos] if bos is not None else []) + prompt
            state = self.lm.new_state(1)
            for k, chunk in enumerate(self._chunks(ids)):
                if k:
                    yield  # let decode steps run between chunks
                _, state = self.lm.consume(chunk, state)
            return Consumed([], self._commit(None, state), int(state.n_tokens[0]))

        return await self.scheduler.call(run, len(prompt) + 1)

    async def score(self, source: StateSource, tokens: list[int], keep_state: bool) -> Consumed:
        """Teacher-forced log-probs of `tokens` continuing the source state (and the new state)."""

        def run() -> Generator[None, None, Consumed]:
            st = self._load(source)
            values: list[float | None] = []
            for k, chunk in enumerate(self._chunks(tokens)):
                if k:
                    yield  # let decode steps run between chunks
                lps, st = self.lm.consume(chunk, st)
                values += [None if math.isnan(x) else x for x in lps[0].tolist()]
            return Consumed(values, self._commit(source, st) if keep_state else None, int(st.n_tokens[0]))

        return await self.scheduler.call(run, len(tokens))

    def generate(
        self,
        source: StateSource,
        prompt: list[int],
        params: SamplingParams,
        *,
        seed: int | None,
        max_tokens: int,
        stop: list[str],
    ) -> Generation:
        """Start a generation; iterate the result for its tokens, then read `.result`.

        Raises QueueFull when the scheduler's queue is at its limit."""
        gen = Generation(
            source=source, prompt=prompt, params=params, seed=seed, max_tokens=max_tokens, stop=stop
        )
        self.scheduler.submit(gen)
        return gen
