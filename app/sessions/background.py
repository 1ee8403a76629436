"""Background responses: a generation detached from its client, whose events any replica
replays, and which never stays in progress after its replica dies.

The worker is a task on the replica that took the request. It appends each event to the
response's event list in Redis (its index is its `sequence_number`, so a reader that asks
for the events after N gets each one it missed exactly once) and, with each event and at
least every third of `lease` seconds, renews its lease: in the response's hash and in the
register of leases (a sorted set by lease end). It writes only while the response is
active, so a cancel (from any replica) or a failure another replica wrote stops it, and
it discards the state its generation made.

Every replica sweeps the register every half lease: a response whose lease lapsed (its
worker's replica died, or stalled past its lease) is marked `failed`, with a
`response.failed` event last in its list. So a dead replica's response is failed within
1.5 x `lease` seconds of its last renewal; it is never resumed (its generation's sampled
tokens died with it, and a resumed one could not be the same reply).

The events themselves are framed by the caller (app/api): this module only keeps them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from app import metrics
from app.store import ResponseStore, StoreError

from .responses import body_of, dumps

log = logging.getLogger("recur.responses")
POLL = 0.05  # seconds between a replaying reader's reads of a response still running
DIED = "the replica running this background response stopped before it ended"
FAILED = "the background response failed as it ended: nothing was kept"


class Background:
    def __init__(self, store: ResponseStore, lease: float, retention: int):
        self.store = store
        self.lease = lease
        self.retention = retention
        self.workers: dict[str, asyncio.Task[None]] = {}
        self._sweeper: asyncio.Task[None] | None = None

    async def queue(self, response_id: str, owner: str, body: dict) -> None:
        """Register a background response (status `queued`) before its worker starts."""
        until = time.time() + self.lease
        record = {
            "status": str(body["status"]),
            "body": dumps(body),
            "background": "1",
            "lease": f"{until:.3f}",
        }
        await self.store.save("response", response_id, owner, self.retention, record)
        await self.store.lease("add", response_id, until)

    def detach(
        self,
        response_id: str,
        owner: str,
        events: AsyncIterator[dict],
        end: Callable[[dict], Awaitable[object]],
        stop: Callable[[], Awaitable[object]],
    ) -> None:
        """Run `events` to their end in a task of this replica's; `end(last event)` once
        they all are kept, `stop()` if the response was stopped (cancelled or failed)."""

        async def work() -> None:
            beat = asyncio.ensure_future(self._beat(response_id, owner, asyncio.current_task()))
            last: dict | None = None
            seq = 0
            settled = True  # whether the response has ended in Redis, or must wait for the sweep
            try:
                async for event in events:
                    event["sequence_number"] = seq
                    if not await self._append(response_id, owner, event):
                        break
                    seq, last = seq + 1, event
                else:
                    if last is not None:
                        await end(last)
                    return
                await stop()
            except asyncio.CancelledError:
                await asyncio.shield(stop())
            except Exception:
                log.exception("background response %s failed", response_id)
                settled = await self._fail(response_id)
                with contextlib.suppress(Exception):
                    await stop()
            finally:
                beat.cancel()
                if settled:
                    with contextlib.suppress(Exception):
                        await asyncio.shield(self.store.lease("drop", response_id))
                with contextlib.suppress(Exception):
                    await events.aclose()  # type: ignore[attr-defined]

        task = asyncio.ensure_future(work())
        self.workers[response_id] = task
        task.add_done_callback(lambda _: self.workers.pop(response_id, None))

    async def _fail(self, response_id: str) -> bool:
        """Mark a response whose worker failed (its final save, or a write to Redis raised)
        as failed at once; False if that failed too, so the lease stays in the register and
        the sweep fails it when it lapses."""
        try:
            if await self.store.expire(response_id, FAILED, now=True) == "failed":
                metrics.RESPONSES.labels("failed").inc()
            return True
        except Exception:
            log.warning("could not fail background response %s: the sweep will", response_id)
            return False

    async def _append(self, response_id: str, owner: str, event: dict) -> bool:
        """Keep an event (and the response's body, when it carries one); False once stopped."""
        until = time.time() + self.lease
        ok = await self.store.append_event(response_id, owner, dumps(event), until, self.retention)
        body = event.get("response")
        if ok and body is not None and body.get("status") in ("queued", "in_progress"):
            record = {"status": str(body["status"]), "body": dumps(body)}
            ok = await self.store.save("response", response_id, owner, self.retention, record, worker=True)
        return ok

    async def _beat(self, response_id: str, owner: str, worker: asyncio.Task | None) -> None:
        """Renew the lease every third of it; stop the worker once the response is stopped."""
        while True:
            await asyncio.sleep(self.lease / 3)
            until = time.time() + self.lease
            try:
                alive = await self.store.append_event(response_id, owner, "", until, self.retention)
                await self.store.lease("add", response_id, until)
            except StoreError:
                continue  # Redis away: the lease may lapse, and the sweep then fails the response
            if not alive and worker is not None:
                worker.cancel()
                return

    async def cancel(self, response_id: str, owner: str) -> tuple[str, dict | None]:
        """Cancel a background response: ('ok' or 'ended', its body) or ('foreground', None).
        Its worker, on whichever replica, stops at its next write; here, at once."""
        status, body = await self.store.cancel(response_id, owner)
        if status == "ok":
            metrics.RESPONSES.labels("cancelled").inc()
            worker = self.workers.get(response_id)
            if worker is not None:
                worker.cancel()
        return status, body_of(body) if body else None

    async def replay(self, response_id: str, owner: str, after: int) -> AsyncIterator[dict]:
        """The events after sequence number `after` (-1: all), as they come, until the
        response has ended and every event is out."""
        start = after + 1
        while True:
            ended, events = await self.store.events(response_id, owner, start)
            for raw in events:
                event = json.loads(raw)
                if isinstance(event.get("response"), dict):
                    event["response"] = body_of(json.dumps(event["response"]))
                yield event
            start += len(events)
            if ended and not events:
                return
            if not events:
                await asyncio.sleep(POLL)

    # -- the sweep ------------------------------------------------------------------------------
    def start(self) -> None:
        self._sweeper = asyncio.ensure_future(self._sweep())

    async def close(self) -> None:
        tasks = [t for t in (self._sweeper, *self.workers.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.lease / 2)
            try:
                await self.sweep()
            except StoreError:
                log.warning("could not sweep the background responses' leases", exc_info=True)

    async def sweep(self) -> None:
        """Fail each background response whose worker's lease lapsed (see the module)."""
        due, count = await self.store.lease("due")
        metrics.RESPONSES_BACKGROUND_QUEUED.set(count)
        for response_id in due:
            status = await self.store.expire(response_id, DIED)
            if status == "failed":
                metrics.RESPONSES.labels("failed").inc()
                log.warning("background response %s failed: its worker's lease lapsed", response_id)
            if status != "alive":  # (a live worker's next renewal moves it on in the register)
                await self.store.lease("drop", response_id)
