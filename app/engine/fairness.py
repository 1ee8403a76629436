"""Fairness between clients in the engine's batch: who is admitted next, and how many rows
each client may hold. The scheduler (app/engine/scheduler.py) keeps the rows and asks here.

A client is a `Request.client`: an API key's owner, or, without a key, its address. Each client
waits in its own line, and admission takes from the line of the client with the fewest
rows running. A client alone may fill the batch. While a client with little work (less
than `Fairness.batch_share` of the batch) is active beside it (or was, within the last
LINGER_STEPS steps), a client holds at most that share: past it, the scheduler parks its
newest rows, their states kept (a recurrent state is small, so parking costs nothing to
resume), at the front of its line. So one client's flood never makes another's steps much
longer than they are alone. Clients that all have much work split the batch evenly.

Everything here runs on the engine thread; it never touches a row's state.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .requests import Request
    from .runner import Row

# a client whose last request just ended still counts as active for this many steps: one that
# sends request after request is not met by a batch that another client filled in between
LINGER_STEPS = 50


@dataclass(frozen=True)
class Fairness:
    """How the scheduler shares the engine between clients (see the module docstring)."""

    batch_share: float = 1.0  # of max_batch_size, a client's while a lighter one is active
    queue_share: float = 1.0  # of the queue's requests and tokens, one client's at most
    buffer_tokens: int = 0  # unread tokens past which a stream is paused (0: never)


NO_FAIRNESS = Fairness()  # one line for all, whole batch, never paused


class Shares:
    """The clients' lines and their shares of a batch of `max_batch_size` rows."""

    def __init__(self, fairness: Fairness, max_batch_size: int):
        self.max_batch_size = max_batch_size
        self.share = max(1, math.floor(fairness.batch_share * max_batch_size))  # rows
        # each client's line: parked rows (to resume) first, then its requests in arrival order
        self.lines: dict[str, collections.deque[Request | Row]] = {}
        self._steps = 0  # admissions so far: the clock
        self._seen: dict[str, int] = {}  # each client's last step with work

    def tick(self, running: collections.Counter[str], waiting: set[str]) -> None:
        """An admission begins: the clients running or waiting are seen now."""
        self._steps += 1
        for t in waiting | set(running):
            self._seen[t] = self._steps

    def active(self, running: collections.Counter[str], waiting: set[str]) -> set[str]:
        """The clients with work, and those that had some within LINGER_STEPS."""
        self._seen = {t: at for t, at in self._seen.items() if self._steps - at <= LINGER_STEPS}
        return waiting | {t for t, n in running.items() if n} | set(self._seen)

    def next_client(self, running: collections.Counter[str], waiting: set[str]) -> str | None:
        """The waiting client with the fewest rows running, among those under their cap."""
        active = self.active(running, waiting)
        allowed = [t for t in waiting if running[t] < self.cap(t, running, active)]
        return min(allowed, key=lambda t: running[t], default=None)

    def cap(self, client: str, running: collections.Counter[str], active: set[str]) -> int:
        """The most rows `client` may hold now: the whole batch alone; its share while a
        lighter client (one that wants less than a share) is active; else an even split."""
        others = active - {client}
        if not others:
            return self.max_batch_size
        if any(self._wants(t, running) < self.share for t in others):
            return self.share
        return max(self.share, self.max_batch_size // len(active))

    def _wants(self, client: str, running: collections.Counter[str]) -> int:
        return running[client] + len(self.lines.get(client, ()))
