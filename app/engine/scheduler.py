"""The scheduler: decides what runs in the engine's next step; the runner executes it.

Requests wait in arrival order. Each step the scheduler
  1. admits waiting requests while fewer than `max_batch_size` are running;
  2. picks the next prompt chunk (`lm.segment_len` tokens) of every admitted request that
     still has prompt to consume, grouped by chunk length so each group is one forward
     pass without padding: a long prompt never stalls the others for more than a chunk;
  3. picks every request whose prompt is consumed and that still samples, for ONE decode
     step all together;
  4. hands back the requests that are done (their last token sampled, or, asking for no
     tokens, their prompt consumed).
A cancelled request leaves before its next step: nothing of it is committed.

Admission control: requests not yet admitted are bounded by `max_queued_requests` and
their prompt tokens by `max_queued_tokens`; past either, `submit` raises QueueFull at
once (the API's 429).

`submit` and the two counters are called from the event loop; everything else runs on
the engine thread.
"""

from __future__ import annotations

import collections
import queue
import threading

from .requests import QueueFull, Request
from .runner import Row

_STOP = object()  # the inbox item that ends the engine thread


class Scheduler:
    def __init__(
        self, *, max_batch_size: int, max_queued_requests: int, max_queued_tokens: int, segment_len: int
    ):
        self.max_batch_size = max_batch_size
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.segment_len = segment_len
        self._queue_lock = threading.Lock()
        self.queued_requests = 0
        self.queued_tokens = 0
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: collections.deque[Request] = collections.deque()
        self._prefilling: list[Row] = []
        self._decoding: list[Row] = []
        self._done: list[Row] = []
        self._num_running = 0

    # -- the event loop's side ---------------------------------------------------------------
    @property
    def num_running(self) -> int:
        """Requests admitted (consuming their prompt or decoding), as of the last step:
        published once per step, so a reader on another thread never sees a row counted
        twice while it moves between lists."""
        return self._num_running

    @property
    def num_waiting(self) -> int:
        """Requests submitted and not yet admitted."""
        return self.queued_requests

    def submit(self, req: Request) -> None:
        """Queue a request; raises QueueFull when the queue is at its limits."""
        tokens = len(req.prompt)
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
        self._inbox.put(req)

    def close(self) -> None:
        self._inbox.put(_STOP)

    # -- the engine thread's side ------------------------------------------------------------
    @property
    def idle(self) -> bool:
        return not (self._waiting or self._prefilling or self._decoding or self._done)

    def receive(self, wait: bool, timeout: float | None = None) -> bool:
        """Take newly submitted requests, first waiting (up to `timeout`) for one if `wait`.
        False once the engine is closing."""
        items = []
        if wait:
            try:
                items.append(self._inbox.get(timeout=timeout))
            except queue.Empty:
                pass
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        if any(item is _STOP for item in items):
            return False
        self._waiting.extend(items)
        return True

    def admit(self) -> list[Request]:
        """Requests to start now (their states are loaded, then `add`ed)."""
        out: list[Request] = []
        while self._waiting and self._num_admitted() + len(out) < self.max_batch_size:
            req = self._waiting.popleft()
            with self._queue_lock:
                self.queued_requests -= 1
                self.queued_tokens -= len(req.prompt)
            if not req.cancelled:
                out.append(req)
        return out

    def add(self, row: Row) -> None:
        self._place(row)

    def prefill_groups(self) -> list[tuple[int, list[Row]]]:
        """This step's prompt chunks: (chunk length, the rows that consume one that long)."""
        self._prefilling = [r for r in self._prefilling if not r.req.cancelled]
        groups: dict[int, list[Row]] = collections.defaultdict(list)
        for r in self._prefilling:
            groups[min(self.segment_len, len(r.pending))].append(r)
        return list(groups.items())

    def prefilled(self) -> None:
        """Move the rows whose prompt is now consumed on (to decoding, or done)."""
        rows, self._prefilling = self._prefilling, []
        for r in rows:
            self._place(r)

    def decode_batch(self) -> list[Row]:
        """The rows that sample a token in this step."""
        self._decoding = [r for r in self._decoding if not r.req.cancelled]
        return list(self._decoding)

    def take_done(self) -> list[Row]:
        """Rows that have finished, leaving the scheduler."""
        done = self._done + [r for r in self._decoding if r.finish_reason is not None]
        self._decoding = [r for r in self._decoding if r.finish_reason is None]
        self._done = []
        return done

    def drop(self, rows: list[Row]) -> None:
        """Rows whose step failed leave."""
        gone = {id(r) for r in rows}
        self._prefilling = [r for r in self._prefilling if id(r) not in gone]
        self._decoding = [r for r in self._decoding if id(r) not in gone]
        self._done = [r for r in self._done if id(r) not in gone]

    def drop_all(self) -> list[Row]:
        """Every admitted row leaves (after a failed step); returns them."""
        rows = [*self._prefilling, *self._decoding, *self._done]
        self._prefilling, self._decoding, self._done = [], [], []
        return rows

    def publish(self) -> None:
        self._num_running = self._num_admitted()

    def _num_admitted(self) -> int:
        return len(self._prefilling) + len(self._decoding) + len(self._done)

    def _place(self, row: Row) -> None:
        if row.pending:
            self._prefilling.append(row)
        elif row.decoding:
            self._decoding.append(row)
        else:
            self._done.append(row)
