"""Admission control: the requests submitted and not yet admitted, counted against the
queue's limits. Past `max_queued_requests`, or `max_queued_tokens` of their prompts, a
request is refused at once (QueueFull: the API's 429), before any work; one client's
requests may fill only `queue_share` of either, so a client flooding the queue never shuts
another out of it.

Requests are counted from the event loop (and the loader thread) and released by the
engine thread as it admits them: every count is taken under one lock.
"""

from __future__ import annotations

import collections
import math
import threading

from .requests import QueueFull, Request


class QueueLimits:
    def __init__(self, max_requests: int, max_tokens: int, share: float):
        self.max_requests, self.max_tokens, self.share = max_requests, max_tokens, share
        self._lock = threading.Lock()
        self.requests = 0  # submitted, not yet admitted
        self.tokens = 0  # their prompt tokens
        self._requests_by: collections.Counter[str] = collections.Counter()  # by client
        self._tokens_by: collections.Counter[str] = collections.Counter()

    def reserve(self, req: Request) -> None:
        """Count `req` in the queue, or raise QueueFull when the queue, or its client's share
        of it, is at its limits."""
        tokens, client = len(req.prompt), req.client
        with self._lock:
            if self.requests >= self.max_requests:
                raise QueueFull(
                    f"the server's queue is full ({self.requests} requests waiting); retry shortly"
                )
            if self.requests and self.tokens + tokens > self.max_tokens:
                raise QueueFull(
                    f"the server's queue is full ({self.tokens} prompt tokens waiting); retry shortly"
                )
            mine = self._requests_by[client]
            if mine >= math.ceil(self.share * self.max_requests) or (
                mine and self._tokens_by[client] + tokens > self.share * self.max_tokens
            ):
                raise QueueFull(
                    f"this client's requests fill its share of the server's queue ({mine} waiting); "
                    "retry shortly"
                )
            self.requests += 1
            self.tokens += tokens
            self._requests_by[client] += 1
            self._tokens_by[client] += tokens

    def admitted(self, req: Request) -> None:
        """`req` leaves the queue (admitted, or cancelled while it waited)."""
        with self._lock:
            self.requests -= 1
            self.tokens -= len(req.prompt)
            self._requests_by[req.client] -= 1
            self._tokens_by[req.client] -= len(req.prompt)
