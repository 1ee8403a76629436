"""The scheduler: decides what runs in the engine's next step; the runner executes it.

Each step the scheduler
  1. admits waiting requests while fewer than `max_batch_size` are running, fairly
     between clients (below);
  2. picks the next prompt chunk (at most `lm.segment_len` tokens) of admitted requests
     that still have prompt to consume, grouped by chunk length so each group is one
     forward pass without padding (chunked prefill). While other rows decode, the chunks
     of a step hold at most `prefill_tokens_per_step` tokens together for each row
     waiting on its prompt per decoding row (rounded up, up to one segment;
     app/engine/prefill.py), shared in equal chunks and taken in turn: a long prompt
     arriving among streams is consumed over many steps and never stalls them for more
     than that budget, and a burst of prompts arriving together is consumed in chunks
     of one length, one forward for them all (chunking changes no result: boundary
     invariance). With nothing decoding, every prefilling row takes a whole segment per
     step;
  3. picks every request whose prompt is consumed and that still samples, for ONE decode
     step all together;
  4. hands back the requests that are done (their last token sampled, or, asking for no
     tokens, their prompt consumed).
A cancelled request leaves before its next step: nothing of it is committed.

Admission control (app/engine/admission.py): requests not yet admitted are bounded by
`max_queued_requests` and their prompt tokens by `max_queued_tokens`, one client's by
`Fairness.queue_share` of either; past them, `submit` raises QueueFull at once.

Fairness between clients (`Request.client`: an API key's owner, or, without a key, the
caller's address): each client waits in its own line, and admission takes from the one
that `Shares` (app/engine/fairness.py) names; a client past its share beside a lighter one
has its newest rows parked, their states kept, at the front of its line.

A stream whose reader does not read: once `Fairness.buffer_tokens` of its tokens wait
unread, its row is paused (out of the batch, its state kept) until its reader has read
half of them; it never holds a place in the batch while it waits.

`submit` and the counters are called from the event loop; everything else runs on the
engine thread.
"""

from __future__ import annotations

import collections
import queue

from .admission import QueueLimits
from .fairness import NO_FAIRNESS, Fairness, Shares
from .prefill import PrefillBudget
from .requests import Request
from .runner import Plan, Row

_STOP = object()  # the inbox item that ends the engine thread
# prompt tokens one step consumes while other rows decode, for each row waiting on its prompt
# per decoding row (`Settings.prefill_tokens_per_step`): on the shipped models about as long
# as a 16-row decode step takes, so a prompt arriving at most doubles the decoding streams'
# inter-token latency while it is consumed
PREFILL_TOKENS_PER_STEP = 32


class Scheduler:
    def __init__(
        self,
        *,
        max_batch_size: int,
        max_queued_requests: int,
        max_queued_tokens: int,
        segment_len: int,
        prefill_tokens_per_step: int = PREFILL_TOKENS_PER_STEP,
        fairness: Fairness = NO_FAIRNESS,
    ):
        self.max_batch_size = max_batch_size
        self.prefill = PrefillBudget(prefill_tokens_per_step, segment_len)
        self.fairness = fairness
        self.shares = Shares(fairness, max_batch_size)
        self.limits = QueueLimits(max_queued_requests, max_queued_tokens, fairness.queue_share)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lines = self.shares.lines  # each client's: parked rows (to resume) first, then its requests
        self._prefilling: list[Row] = []
        self._decoding: list[Row] = []
        self._done: list[Row] = []
        self._paused: list[Row] = []  # streams whose readers do not read
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
        return self.limits.requests

    def submit(self, req: Request) -> None:
        """Queue a request; raises QueueFull when the queue, or its client's share of it, is
        at its limits."""
        self.reserve(req)
        self.deliver(req)

    def deliver(self, req: Request) -> None:
        """Hand a `reserve`d request to the engine thread (from any thread)."""
        self._inbox.put(req)

    def reserve(self, req: Request) -> None:
        """Count a request in the queue before it is delivered (its stored state is parsed
        meanwhile); raises QueueFull as `submit` does."""
        self.limits.reserve(req)

    def close(self) -> None:
        self._inbox.put(_STOP)

    # -- the engine thread's side ------------------------------------------------------------
    @property
    def idle(self) -> bool:
        return not (
            any(self._lines.values()) or self._prefilling or self._decoding or self._done or self._paused
        )

    def receive(self, wait: bool, timeout: float | None = None) -> bool:
        """Take newly submitted requests, first waiting (up to `timeout`) for one if `wait`.
        False once the engine is closing."""
        items = []
        if not wait and self._only_paused():  # (nothing to run: look in again soon, never spin)
            wait, timeout = True, 0.01
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
        for req in items:
            self._lines.setdefault(req.client, collections.deque()).append(req)
        return True

    def admit(self) -> list[Request]:
        """Requests to start now (their states are loaded, then `add`ed). Parked and paused
        rows that may run again are placed back here themselves."""
        self._pause_unread()
        self._resume_read()
        running = collections.Counter(r.req.client for r in self._running())
        waiting = {t for t, line in self._lines.items() if line}
        self.shares.tick(running, waiting)
        self._park_past_share(running, waiting)
        out: list[Request] = []
        while sum(running.values()) < self.max_batch_size:
            client = self.shares.next_client(running, waiting)
            if client is None:
                break
            item = self._lines[client].popleft()
            if not self._lines[client]:
                waiting.discard(client)
            if isinstance(item, Row):
                if not item.req.cancelled:
                    self._place(item)
                    running[client] += 1
                continue
            self.limits.admitted(item)
            if not item.cancelled:
                out.append(item)
                running[client] += 1
        return out

    def add(self, row: Row) -> None:
        self._place(row)

    def schedule(self) -> Plan:
        """This step's plan: the prompt chunks (`prefill_groups`), and the rows that sample a
        token, those decoding and then those whose prompt this step's chunk ends (they
        sample in the same step, as they did when their prompt ended before it)."""
        self._decoding = [r for r in self._decoding if not r.req.cancelled]  # (before the budget counts them)
        groups = self.prefill_groups()
        ends = {
            id(r) for size, rows in groups for r in rows if size == len(r.pending) and r.req.max_tokens > 0
        }
        self.publish()  # (before any token of this step is sent)
        return Plan(groups, [*self._decoding, *(r for r in self._prefilling if id(r) in ends)])

    def update(self, failed: list[Row]) -> list[Row]:
        """Take the step's outcome: the rows that failed leave, the rows whose prompt is
        consumed move on (to decoding, or done); returns the rows that are done, leaving."""
        self.drop(failed)
        self.prefilled()
        return self.take_done()

    def prefill_groups(self) -> list[tuple[int, list[Row]]]:
        """This step's prompt chunks: (chunk length, the rows that consume one that long), as
        the budget shares them out (`PrefillBudget`); the rows served go to the back of the
        line, so that prefilling rows take the budget in turn."""
        rows = [r for r in self._prefilling if not r.req.cancelled]
        groups, served = self.prefill.chunks(rows, len(self._decoding))
        self._prefilling = rows[served:] + rows[:served]
        return groups

    def prefilled(self) -> None:
        """Move the rows whose prompt is now consumed on (to decoding, or done)."""
        rows, self._prefilling = self._prefilling, []
        for r in rows:
            self._place(r)

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

    def in_flight(self) -> list[Request]:
        """The requests of every admitted row."""
        return [r.req for r in (*self._prefilling, *self._decoding, *self._done)]

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

    # -- fairness (app/engine/fairness.py decides; the rows are the scheduler's) ----------------
    def _running(self) -> list[Row]:
        return [*self._prefilling, *self._decoding, *self._done]

    def _park_past_share(self, running: collections.Counter[str], waiting: set[str]) -> None:
        """Rows of a client past its cap go back to the front of its line, newest first
        out: a row still consuming its prompt before one that is decoding."""
        active = self.shares.active(running, waiting)
        if len(active) < 2:
            return
        for client in list(running):
            excess = running[client] - self.shares.cap(client, running, active)
            if excess <= 0:
                continue
            mine = [r for r in (*self._decoding, *self._prefilling) if r.req.client == client]
            parked = mine[-excess:]
            self.drop(parked)
            line = self._lines.setdefault(client, collections.deque())
            line.extendleft(reversed(parked))
            running[client] -= len(parked)
            waiting.add(client)

    def _only_paused(self) -> bool:
        return bool(self._paused) and not (
            any(self._lines.values()) or self._prefilling or self._decoding or self._done
        )

    def _pause_unread(self) -> None:
        """Streams whose readers have left `buffer_tokens` tokens unread leave the batch."""
        limit = self.fairness.buffer_tokens
        if not limit:
            return
        slow = [r for r in self._decoding if r.req.unread > limit]
        if slow:
            self.drop(slow)
            self._paused += slow

    def _resume_read(self) -> None:
        """Paused streams whose readers have read half their backlog wait to run again (at
        the front of their client's line); those whose readers left, leave."""
        still: list[Row] = []
        back: list[Row] = []
        for r in self._paused:
            if r.req.cancelled:
                continue
            (back if r.req.unread <= self.fairness.buffer_tokens // 2 else still).append(r)
        self._paused = still
        for r in reversed(back):
            self._lines.setdefault(r.req.client, collections.deque()).appendleft(r)
