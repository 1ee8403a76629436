"""The engine: the model, its tokenizer, and the one thread that runs it.

`Engine.submit(request)` queues a `Request` (see requests.py) and returns at once; the
engine thread loops: take new requests, let the scheduler choose this step's work, let
the runner execute it. Tokens and the outcome flow back through the request itself.

The engine speaks in token ids, states and state bytes: it never builds an HTTP
response, never speaks to Redis, and imports only `model/` and its own modules. Every
tensor is touched on its thread, so inference never blocks the event loop.
"""

from __future__ import annotations

import logging
import threading

import torch

from model import LanguageModel
from model.grammar import Grammars
from model.tokenizer import Tokenizer

from . import openmp
from .compiler import MODEL_LOCK, DecodeStep, serialise_tracing
from .encoder import Encoder
from .fairness import NO_FAIRNESS, Fairness
from .loader import Loader
from .malloc import MallocTrimmer
from .requests import Failed, Outbox, Request, Stored
from .runner import Counters, Done, Runner
from .scheduler import PREFILL_TOKENS_PER_STEP, Scheduler
from .watchdog import Watchdog

log = logging.getLogger("recur.engine")

IDLE_RELEASE_DELAY = 1.0  # seconds without work before freed memory is handed back


class Engine:
    def __init__(
        self,
        lm: LanguageModel,
        *,
        name: str,
        max_batch_size: int,
        max_queued_requests: int,
        max_queued_tokens: int,
        cpu_threads: int,
        compile: bool,
        malloc_trim_interval: float,
        step_deadline: float,
        prefill_tokens_per_step: int = PREFILL_TOKENS_PER_STEP,
        fairness: Fairness = NO_FAIRNESS,
    ):
        if lm.tokenizer is None:
            raise ValueError("the model has no tokenizer")
        if cpu_threads:
            # tiny decode steps gain nothing from intra-op threads and lose a lot to contention
            torch.set_num_threads(cpu_threads)
        self.lm = lm
        self.name = name
        self.tokenizer: Tokenizer = lm.tokenizer
        self.grammars = Grammars(self.tokenizer)  # compiles a request's grammar (off this thread)
        self.fingerprint = lm.fingerprint
        self.scheduler = Scheduler(
            max_batch_size=max_batch_size,
            max_queued_requests=max_queued_requests,
            max_queued_tokens=max_queued_tokens,
            segment_len=lm.segment_len,
            prefill_tokens_per_step=prefill_tokens_per_step,
            fairness=fairness,
        )
        self.outbox = Outbox()  # events go back to the event loop once per step
        # eager until a compiled one is measured faster, per batch class
        self.decode_step = DecodeStep(lm, compile, max_rows=max_batch_size)
        self.runner = Runner(lm, self.tokenizer, self.decode_step, self.outbox)
        # stored states are parsed off this thread
        self.loader = Loader(lm, self.scheduler.deliver, self.runner.counters)
        # and finished states encoded off it, once their step's events are out
        self.encoder = Encoder(lm, self.runner.counters)
        self._done: list[tuple[Request, Done]] = []  # this step's finished rows, to seal
        self.trimmer = MallocTrimmer(malloc_trim_interval)
        self.watchdog = Watchdog(step_deadline)  # a step past it fails its requests
        serialise_tracing()  # a trace elsewhere in the process (a compile) never meets a step
        self._thread = threading.Thread(target=self._loop, name="recur-engine", daemon=True)

    # -- the event loop's side ---------------------------------------------------------------
    def start(self) -> None:
        """Start the engine's threads. The calling thread (the event loop's, which loaded or
        was given the model) leaves the cores' OpenMP threads to the engine's from now on
        (`openmp.step_aside`): with a pool of its own alive, every step ran at half speed."""
        self._thread.start()
        self.watchdog.start()
        self.decode_step.start()
        openmp.step_aside()

    def stop(self) -> None:
        self.watchdog.stop()
        self.loader.close()
        self.scheduler.close()
        self._thread.join(timeout=10)
        self.encoder.close()

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    @property
    def counters(self) -> Counters:
        """What the engine has done so far (steps, tokens, seconds loading and encoding)."""
        return self.runner.counters

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def submit(self, req: Request) -> Request:
        """Queue `req` and return it: iterate it for its tokens, or await `req.finished()`.
        Raises QueueFull when the scheduler's queue is at its limit, EngineStalled while a
        step has run past its deadline. A stored start is parsed by the loader thread first."""
        self.watchdog.check()
        if isinstance(req.start, Stored):
            self.scheduler.reserve(req)  # (a full queue refuses it before a byte is parsed)
            self.loader.submit(req)
        else:
            self.scheduler.submit(req)
        return req

    # -- the engine thread -------------------------------------------------------------------
    def _loop(self) -> None:
        with torch.no_grad():
            while self._receive():
                admitted = self.scheduler.admit()
                with self.watchdog.watching([*self.scheduler.in_flight(), *admitted]):
                    try:
                        with MODEL_LOCK:  # no torch.fx trace runs meanwhile (compiler.py)
                            self._step(admitted)
                    except Exception as exc:  # the thread must survive: fail what is in flight
                        log.exception("engine step failed")
                        for row in self.scheduler.drop_all():
                            self.outbox.put(row.req, Failed.of(exc))
                        self.runner.reset()
                self.publish()
                self.trimmer.worked()

    def _receive(self) -> bool:
        """Take new requests, waiting for one when there is no work. Memory freed by the last
        requests is given back once the whole process has been quiet for
        `IDLE_RELEASE_DELAY` (their state bytes are freed by the event loop after their
        commits, not by this thread)."""
        s = self.scheduler
        if s.idle and self.trimmer.pending:
            if not s.receive(wait=True, timeout=IDLE_RELEASE_DELAY):
                return False
            if s.idle:
                self.trimmer.idle()
        return s.receive(wait=s.idle)

    def _step(self, admitted: list[Request]) -> None:
        """Schedule, execute, update (as vLLM's engine core steps): the scheduler decides,
        the runner runs its plan, and the scheduler takes the outcome. One bad row never
        fails the batch: a row whose own part failed leaves alone, with its error."""
        s, r, out = self.scheduler, self.runner, self.outbox
        for req in admitted:
            try:
                s.add(r.load(req))
            except Exception as exc:  # a damaged or inconsistent stored state, say
                out.put(req, Failed.of(exc))
        plan = s.schedule()
        failed = r.execute(plan)
        for row, error in failed:
            log.warning("a request failed alone: %s", error)
            out.put(row.req, Failed.of(error))
        for row in s.update([row for row, _ in failed]):
            try:
                self._done.append((row.req, r.finish(row)))
            except Exception as exc:
                out.put(row.req, Failed.of(exc))

    def publish(self) -> None:
        """The end of a step: its events go to the event loop, then its finished rows to the
        encoder thread (so each outcome follows its request's last token)."""
        self.outbox.flush()
        self.scheduler.publish()
        done, self._done = self._done, []
        for req, row in done:
            self.encoder.submit(req, row)
