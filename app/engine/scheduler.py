"""The scheduler: one thread that owns the model and decides what runs at each step.

Each loop iteration it (1) advances every queued job (create, score) by one chunk of
`lm.segment_len` tokens, (2) admits waiting
generations up to `max_batch_size` and loads their state, (3) consumes the next chunk
(`lm.segment_len` tokens) of each admitted generation's prompt, batching the rows whose
chunks have the same length into one forward pass, so a long prompt never stalls the
others for more than one chunk, and (4) runs ONE decode step for every
generation whose prompt is consumed, all together: the rows' states are
stacked into one batch (`lm.stack_states`), the next tokens are sampled with per-row
parameters, and the sampled tokens are consumed in one forward pass. Rows leave the batch
when they finish or are cancelled (`lm.split_state`). Batching changes no result: each
row's logits depend only on its own state.

Admission control: requests waiting to start (generations not yet admitted, jobs not
yet begun) are bounded by `max_queued_requests` and their prompt tokens by
`max_queued_tokens`; past either, `submit`/`call` raise QueueFull at once (the API's 429).

Only this thread touches tensors or the model; it never blocks the event loop and never
builds an HTTP response. Results go back through `Generation.push` or a future.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch

from model import LanguageModel, State
from model.sampling import make_generator, sample
from model.tokenizer import StreamDecoder, Tokenizer

from .memory import Releaser
from .requests import Commit, EmptyContext, Failed, Finished, Generation, QueueFull, StateSource, TokenEvent

log = logging.getLogger("recur.engine")

IDLE_RELEASE_DELAY = 1.0  # seconds without work before freed memory is handed back


@dataclass
class _Job:
    """Work done in chunks: `fn()` is a generator that yields after each chunk and
    returns the result, so a long job never holds up the decode steps for long."""

    fn: Callable[[], Generator[None, None, Any]]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    tokens: int = 0  # counted against the queue limits until the job starts
    steps: Generator[None, None, Any] | None = None


@dataclass
class _Running:
    """A generation admitted to the batch, with its decoding progress."""

    req: Generation
    state: State
    generator: torch.Generator
    decoder: StreamDecoder
    pending: list[int] = field(default_factory=list)  # prompt tokens not yet consumed
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


def _resolve(fut: asyncio.Future, value: Any = None, error: BaseException | None = None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)


class Scheduler:
    def __init__(
        self,
        lm: LanguageModel,
        *,
        decode: Callable[[torch.Tensor, State], tuple[torch.Tensor, State]] | None = None,
        load: Callable[[StateSource], State],
        commit: Callable[[StateSource | None, State], Commit],
        max_batch_size: int = 32,
        max_queued_requests: int = 256,
        max_queued_tokens: int = 262_144,
        malloc_trim_interval: float = 0.0,
    ):
        if lm.tokenizer is None:
            raise ValueError("the model has no tokenizer")
        self.lm = lm
        self.tokenizer: Tokenizer = lm.tokenizer
        self._load_state, self._commit_state = load, commit
        self._decode = decode or lm.forward  # the one-token step (possibly compiled)
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self._queue_lock = threading.Lock()
        self.queued_requests = 0
        self.queued_tokens = 0
        self.max_batch_size = max_batch_size
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: collections.deque[Generation] = collections.deque()
        self._jobs: list[_Job] = []
        self._prefilling: list[_Running] = []
        self._running: list[_Running] = []
        self._batch: State | None = None  # stacked states of _members, row i = _members[i]
        self._members: list[_Running] = []
        self._num_running = 0
        self.memory = Releaser(malloc_trim_interval)
        self._thread = threading.Thread(target=self._loop, name="recur-scheduler", daemon=True)
        self.stats = {"steps": 0, "tokens": 0, "max_batch": 0}

    @property
    def num_running(self) -> int:
        """Sessions in the running batch (decoding or consuming their prompt), as of the
        scheduler's last step: read from other threads, so the scheduler publishes it once
        per step rather than letting a reader add up lists it is moving rows between."""
        return self._num_running

    @property
    def num_waiting(self) -> int:
        """Requests queued for the scheduler, not yet started."""
        return self.queued_requests

    # -- called from the event loop ----------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def _enqueue(self, tokens: int) -> None:
        with self._queue_lock:
            if self.queued_requests >= self.max_queued_requests:
                raise QueueFull(
                    f"the server's queue is full ({self.queued_requests} requests waiting); retry shortly"
                )
            if self.queued_requests and self.queued_tokens + tokens > self.max_queued_tokens:
                raise QueueFull(
                    f"the server's queue is full ({self.queued_tokens} prompt tokens waiting); retry shortly"
                )
            self.queued_requests += 1
            self.queued_tokens += tokens

    def _dequeue(self, tokens: int) -> None:
        with self._queue_lock:
            self.queued_requests -= 1
            self.queued_tokens -= tokens

    def submit(self, gen: Generation) -> None:
        """Queue a generation; raises QueueFull when the queue is at its limits."""
        self._enqueue(len(gen.prompt))
        self._inbox.put(gen)

    def call(self, fn: Callable[[], Generator[None, None, Any]], tokens: int = 0) -> asyncio.Future:
        """Run the chunked job `fn` on the scheduler thread; the future gets its result.
        Raises QueueFull when the queue is at its limits."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._enqueue(tokens)
        self._inbox.put(_Job(fn, loop, fut, tokens))
        return fut

    # -- the scheduler thread ----------------------------------------------------------------
    def _loop(self) -> None:
        with torch.no_grad():
            while True:
                idle = not (self._jobs or self._running or self._prefilling or self._waiting)
                items = [self._wait()] if idle else []
                while True:
                    try:
                        items.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                for item in items:
                    if item is None:
                        return
                    if isinstance(item, _Job):
                        self._jobs.append(item)
                    else:
                        self._waiting.append(item)
                self._advance_jobs()
                try:
                    self._admit()
                    self._prefill()
                    self._publish()  # before any token of this step is sent
                    if self._running:
                        self._step()
                except Exception as exc:  # the thread must survive: fail what is in flight
                    log.exception("scheduler step failed")
                    self._fail_all(exc)
                self._publish()
                self.memory.worked()

    def _publish(self) -> None:
        self._num_running = len(self._running) + len(self._prefilling)

    def _wait(self) -> Any:
        """The next inbox item, when there is no work. Memory freed by the last requests is
        given back once the whole process has been quiet for `IDLE_RELEASE_DELAY` (their
        state bytes are freed by the event loop after their commits, not by this thread)."""
        if self.memory.pending:
            try:
                return self._inbox.get(timeout=IDLE_RELEASE_DELAY)
            except queue.Empty:
                self.memory.idle()
        return self._inbox.get()

    def _fail_all(self, exc: BaseException) -> None:
        for r in [*self._running, *self._prefilling]:
            r.req.push(Failed(exc))
        self._running, self._prefilling, self._members, self._batch = [], [], [], None

    def _advance_jobs(self) -> None:
        still = []
        for job in self._jobs:
            if job.steps is None:
                self._dequeue(job.tokens)
            if job.future.cancelled():  # the request is gone
                continue
            try:
                if job.steps is None:
                    job.steps = job.fn()
                next(job.steps)
            except StopIteration as done:
                job.loop.call_soon_threadsafe(_resolve, job.future, done.value)
            except Exception as exc:  # delivered to the awaiting request, which maps it
                job.loop.call_soon_threadsafe(_resolve, job.future, None, exc)
            else:
                still.append(job)
        self._jobs = still

    def _admit(self) -> None:
        while self._waiting and len(self._running) + len(self._prefilling) < self.max_batch_size:
            req = self._waiting.popleft()
            self._dequeue(len(req.prompt))
            if req.cancelled:
                continue
            try:
                state = self._load_state(req.source)
                if not req.prompt and int(state.n_tokens[0]) == 0:
                    raise EmptyContext("the session is empty and the model has no BOS token: send a prompt")
            except Exception as exc:
                req.push(Failed(exc))
                continue
            r = _Running(
                req,
                state,
                make_generator(req.seed, self.lm.device),
                self.tokenizer.stream_decoder(),
                list(req.prompt),
            )
            (self._prefilling if r.pending else self._running).append(r)

    def _prefill(self) -> None:
        """Consume one chunk of every admitted prompt; rows whose prompt is done start decoding.

        Rows whose next chunks have the same length run as one batch (no padding needed)."""
        n = self.lm.segment_len
        groups: dict[int, list[_Running]] = collections.defaultdict(list)
        for r in self._prefilling:
            if not r.req.cancelled:
                groups[min(n, len(r.pending))].append(r)
        still: list[_Running] = []
        for size, rows in groups.items():
            chunk = torch.tensor([r.pending[:size] for r in rows], dtype=torch.long, device=self.lm.device)
            try:
                if len(rows) == 1:
                    _, rows[0].state = self.lm(chunk, rows[0].state)
                else:
                    _, batch = self.lm(chunk, self.lm.stack_states([r.state for r in rows]))
                    for r, st in zip(rows, self.lm.split_state(batch), strict=True):
                        r.state = st
            except Exception as exc:
                log.exception("prefill failed")
                for r in rows:
                    r.req.push(Failed(exc))
                continue
            for r in rows:
                r.pending = r.pending[size:]
                (still if r.pending else self._running).append(r)
        self._prefilling = still

    def _rebatch(self) -> None:
        """Make `_batch` hold exactly the running rows (only when membership changed)."""
        if [id(r) for r in self._members] == [id(r) for r in self._running]:
            return
        if self._batch is not None:
            for r, st in zip(self._members, self.lm.split_state(self._batch), strict=True):
                r.state = st
        self._members = list(self._running)
        self._batch = self.lm.stack_states([r.state for r in self._members]) if self._members else None

    def _step(self) -> None:
        # a cancelled or disconnected request leaves before this step: nothing is committed
        self._running = [r for r in self._running if not r.req.cancelled]
        self._rebatch()
        if self._batch is None:
            return
        rows = self._members
        logits = self.lm.next_logits(self._batch)  # (B, V)
        ids, logprobs = sample(logits, [r.req.params for r in rows], [r.generator for r in rows])
        for r, tid, lp in zip(rows, ids.tolist(), logprobs.tolist(), strict=True):
            self._on_token(r, tid, lp)
        _, self._batch = self._decode(ids[:, None], self._batch)
        self.stats["steps"] += 1
        self.stats["tokens"] += len(rows)
        self.stats["max_batch"] = max(self.stats["max_batch"], len(rows))
        done = [r for r in rows if r.finish_reason is not None]
        if done:
            for r, st in zip(rows, self.lm.split_state(self._batch), strict=True):
                r.state = st
            self._batch, self._members = None, []
            for r in done:
                self._finish(r)
            self._running = [r for r in self._running if r.finish_reason is None]

    def _on_token(self, r: _Running, tid: int, logprob: float) -> None:
        tok = self.tokenizer
        r.ids.append(tid)
        text = r.decoder.feed(tid)
        start = max(0, len(r.text) - max((len(s) for s in r.req.stop), default=0) + 1)
        r.text += text
        if tok.eos_id is not None and tid == tok.eos_id:
            r.finish_reason = "eos"
        elif any(s in r.text[start:] for s in r.req.stop):
            r.finish_reason = "stop"
        elif len(r.ids) >= r.req.max_tokens:
            r.finish_reason = "length"
        if r.finish_reason is not None:
            # the last token carries any undecodable tail, so token texts always add up to done.text
            tail = r.decoder.flush()
            text += tail
            r.text += tail
        r.req.push(TokenEvent(len(r.ids) - 1, tid, text, logprob))

    def _finish(self, r: _Running) -> None:
        try:
            commit = self._commit_state(r.req.source, r.state)
        except Exception as exc:
            r.req.push(Failed(exc))
            return
        r.req.push(Finished(r.text, r.finish_reason or "length", r.ids, commit))
