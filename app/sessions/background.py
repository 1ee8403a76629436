"""Background responses: a generation detached from its client, whose events any replica
replays, and which never stays in progress after its replica dies, nor leaves a session
that nothing references.

The worker is a task on the replica that took the request. It appends each event to the
response's events in Redis (a stream whose entries are numbered by `sequence_number`, so a
reader that asks for the events after N gets each one it missed exactly once) and, with
each event and at least every third of `lease` seconds, renews its lease: in the response's
hash and in the register of leases (a sorted set by lease end). It writes only while the
response is active, so a cancel, a delete (from any replica) or a failure another replica
wrote stops it, and it discards the state its generation made. The response's hash names
that session (`run`) from the worker's first write.

Every replica sweeps the register every half lease: a response whose lease lapsed (its
worker's replica died, or stalled past its lease) is marked `failed`, with a
`response.failed` event last, and the session its run made is deleted (once the dead
worker's lock on it lapses: until then the sweep leaves the lease in the register and tries
again). So a dead replica's response is failed within 1.5 x `lease` seconds of its last
renewal; it is never resumed (its generation's sampled tokens died with it, and a resumed
one could not be the same reply).

A replay reads the events a page at a time and, at the end of what is there, waits for
the next one with `XREAD BLOCK` (on a pool of its own: a waiting reader never holds a
connection the requests need). One client runs at most `max_replays` replays at once on a
replica (QuotaExceeded past it, before any read), and its replays together send at most
`replay_rate` bytes a second from it (`Pace`): a replay costs the replica's event loop
per byte sent, so a client that replays a long response in a loop would otherwise take the
loop from every other client's generations.

A worker's writes ride out a Redis stall or a lost connection of up to `RIDE_OUT` seconds
(`_through_stalls`): each is retried with its own op id, which its script recognises, once
Redis answers again; a worker fails its response only past that, not at its first timeout.

The events themselves are framed by the caller (app/api): this module only keeps them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from app import metrics
from app.store import (
    ObjectNotFound,
    QuotaExceeded,
    ResponseRecord,
    ResponseStore,
    StoreError,
    StoreUnavailable,
    new_op_id,
)
from app.tenants import CLIENT, Pace, Tenants

from .responses import Responses

log = logging.getLogger("recur.responses")
PAGE = 64  # events one read of a replay takes
WAIT = 1.0  # seconds one blocking read of a replay waits for the next event (then it reads again)
SETTLING = 0.05  # seconds between reads while a response's last event is out and its status not yet
# the event types that end a response's events (a `response.failed` may still follow one, when
# keeping the response fails as it ends)
# seconds a worker's write rides out a Redis stall before its response fails (`_through_stalls`)
RIDE_OUT = 10.0
LAST = frozenset({"response.completed", "response.incomplete", "response.failed", "error"})
DIED = "the replica running this background response stopped before it ended"
FAILED = "the background response failed as it ended: nothing was kept"
STOPPED = "the server running this background response was stopped before it ended: nothing was kept"


class Replay:
    """One client's replay of a background response's events: `pages()`, then `close()`
    (idempotent), which gives its place among the client's replays back."""

    def __init__(self, background: Background, response_id: str, owner: str, after: int, client: str):
        self.background, self.response_id, self.owner = background, response_id, owner
        self.next = after + 1  # the sequence number of the next event to send
        self.client: str | None = client

    async def pages(self) -> AsyncIterator[list[tuple[str, str]]]:
        """The events after `after`, a page at a time as they come (each event as (its type,
        its JSON)), until the response has ended and its every event is out."""
        store, last = self.background.store, ""
        while True:
            ended, page = await store.events(self.response_id, self.owner, self.next, PAGE)
            if page:
                self.next, last = self.next + len(page), page[-1][0]
                await self.background.pace.take(self.client or "", sum(len(raw) for _, raw in page))
                yield [
                    (kind, await self._failed(raw) if kind == "response.failed" else raw)
                    for kind, raw in page
                ]
            if len(page) == PAGE:
                await asyncio.sleep(0)  # a long replay lets the loop's other work in between pages
            elif ended:
                return
            elif last in LAST:
                # its worker is keeping the body its last event carries: nothing more comes
                # unless that fails (then `response.failed`), and the status says which
                await asyncio.sleep(SETTLING)
            else:
                await store.wait_events(self.response_id, self.next, WAIT)

    async def _failed(self, raw: str) -> str:
        """A `response.failed` event as a replay sends it: one a script wrote (a sweep's
        failure) carries no response, so the stored one, failed, goes in it."""
        event = json.loads(raw)
        if "response" in event:
            return raw
        store, names = self.background.store, ResponseRecord.BODY
        event["response"] = (await store.read(ResponseRecord, self.response_id, self.owner, names)).response
        return _dumps(event)

    async def close(self) -> None:
        if self.client is not None:
            self.background.replay_ended(self.client)
            self.client = None


def _dumps(value: object) -> str:
    return json.dumps(value, separators=(",", ":"))


CLOSE_WAIT = 5.0  # seconds the server's stop waits for its background workers to stop


class Background:
    def __init__(
        self,
        store: ResponseStore,
        responses: Responses,
        tenants: Tenants,
        *,
        lease: float,
        retention: int,
        max_replays: int,
        replay_rate: float = 0.0,
    ):
        self.store = store
        self.responses = responses  # (deletes the session a dead worker's run made)
        self.tenants = tenants
        self.lease = lease
        self.retention = retention
        self.max_replays = max_replays  # replays one client runs at once on this replica
        self.workers: dict[str, asyncio.Task[None]] = {}
        self._replays: collections.Counter[str] = collections.Counter()
        self.pace = Pace(replay_rate)  # bytes a second one client's replays send, together
        self._sweeper: asyncio.Task[None] | None = None
        self._closing = False  # the server is stopping: a worker cancelled now fails its response

    async def queue(self, response_id: str, owner: str, body: dict) -> None:
        """Register a background response (status `queued`) before its worker starts."""
        until = time.time() + self.lease
        record = ResponseRecord(status=str(body["status"]), body=body, background=True, lease=until)
        await self.store.save(response_id, owner, self.retention, record)
        await self.store.lease("add", response_id, until)

    def detach(
        self,
        response_id: str,
        owner: str,
        session: str,
        events: AsyncIterator[dict],
        end: Callable[[dict, int], Awaitable[object]],
        stop: Callable[[], Awaitable[object]],
    ) -> None:
        """Run `events` to their end in a task of this replica's; `end(last event, the
        events' bytes)` once they all are kept, `stop()` if the response was stopped
        (cancelled, deleted or failed). `session`: the one its run made ('' if none), named
        in the response's hash first, for the sweep to delete should this replica die."""

        async def work() -> None:
            beat = asyncio.ensure_future(self._beat(response_id, owner, asyncio.current_task()))
            kept: tuple[dict, int] | None = None
            failed = False
            try:
                kept = await self._keep_events(response_id, owner, session, events)
            except asyncio.CancelledError:
                # cancelled on this replica, or stopped as its beat found; or the server is
                # stopping, and its response fails now, not a lease later
                failed = self._closing
            except Exception:
                log.exception("background response %s failed", response_id)
                failed = True
            finally:
                beat.cancel()
            # shielded: a cancel that comes as it ends must not cut keeping or discarding short
            await asyncio.shield(self._finish(response_id, owner, events, kept, failed, end, stop))

        task = asyncio.ensure_future(work())
        self.workers[response_id] = task
        task.add_done_callback(lambda _: self.workers.pop(response_id, None))

    async def _keep_events(
        self, response_id: str, owner: str, session: str, events: AsyncIterator[dict]
    ) -> tuple[dict, int] | None:
        """Keep each event as it comes (after the run's session is named in the response):
        (the last event, the events' bytes) once all are kept; None once it is stopped."""
        named = ResponseRecord(run=session)
        if session and not await _through_stalls(
            self.store,
            lambda op: self.store.save(response_id, owner, self.retention, named, worker=True, op=op),
        ):
            return None
        last, seq, nbytes = None, 0, 0
        async for event in events:
            event["sequence_number"] = seq
            if not (added := await self._append(response_id, owner, event)):
                return None
            last, seq, nbytes = event, seq + 1, nbytes + added
        return (last, nbytes) if last is not None else None

    async def _finish(
        self,
        response_id: str,
        owner: str,
        events: AsyncIterator[dict],
        kept: tuple[dict, int] | None,
        failed: bool,
        end: Callable[[dict, int], Awaitable[object]],
        stop: Callable[[], Awaitable[object]],
    ) -> None:
        """However a worker ended, once: `end` what it kept, or `stop` it (failed first, if
        it failed); then its lease leaves the register, unless its failure could not be
        written (the sweep fails it when the lease lapses)."""
        settled = True
        try:
            if kept is not None and not failed:
                try:
                    await end(*kept)
                    return
                except Exception:
                    log.exception("background response %s failed as it ended", response_id)
                    failed = True
            if failed:
                settled = await self._fail(response_id, STOPPED if self._closing else FAILED)
            await stop()
            await self._account(response_id, owner)
        except Exception:
            log.warning("could not stop background response %s", response_id, exc_info=True)
        finally:
            if settled:
                with contextlib.suppress(Exception):
                    await self.store.lease("drop", response_id)
            with contextlib.suppress(Exception):
                await events.aclose()  # type: ignore[attr-defined]

    async def _account(self, response_id: str, owner: str) -> None:
        """A stopped response's record and events stay for their retention: the key's ledger
        counts them (unless it was deleted)."""
        try:
            f = await self.store.read(ResponseRecord, response_id, owner, ["body", "events_bytes"])
        except (ObjectNotFound, StoreError):
            return
        body = ResponseRecord(body=f.body).to_fields().get("body", "")
        await self.tenants.recorded(owner, response_id, len(body) + (f.events_bytes or 0), self.retention)

    async def _fail(self, response_id: str, message: str) -> bool:
        """Mark a response whose worker failed (its final save, or a write to Redis raised)
        or was stopped with the server as failed at once, `message` its error's; False if
        that failed too, so the lease stays in the register and the sweep fails it when it
        lapses."""
        try:
            if (await self.store.expire(response_id, message, now=True)).status == "failed":
                metrics.RESPONSES.labels("failed").inc()
            return True
        except Exception:
            log.warning("could not fail background response %s: the sweep will", response_id)
            return False

    async def _append(self, response_id: str, owner: str, event: dict) -> int:
        """Keep an event (and the response's body, when it carries one): its bytes, or 0
        once the response is stopped."""
        until, raw, kind = time.time() + self.lease, _dumps(event), str(event["type"])
        ok = await _through_stalls(
            self.store,
            lambda op: self.store.append_event(response_id, owner, raw, until, self.retention, kind, op),
        )
        body = event.get("response")
        if ok and body is not None and body.get("status") in ("queued", "in_progress"):
            record = ResponseRecord(status=str(body["status"]), body=body)
            ok = await _through_stalls(
                self.store,
                lambda op: self.store.save(response_id, owner, self.retention, record, worker=True, op=op),
            )
        return len(raw) if ok else 0

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
        status, record = await self.store.cancel(response_id, owner)
        if status == "ok":
            metrics.RESPONSES.labels("cancelled").inc()
            worker = self.workers.get(response_id)
            if worker is not None:
                worker.cancel()
        return status, record.response if record else None

    def replay(self, response_id: str, owner: str, after: int) -> Replay:
        """A replay of the events after sequence number `after` (-1: all), for the client
        of this request; QuotaExceeded when it already runs `max_replays` here."""
        client = CLIENT.get() or owner
        if self._replays[client] >= self.max_replays:
            raise QuotaExceeded(
                "replays",
                f"this client replays {self._replays[client]} responses on this server, its limit of "
                f"{self.max_replays}; retry when one has ended",
                1,
            )
        self._replays[client] += 1
        return Replay(self, response_id, owner, after, client)

    def replay_ended(self, client: str) -> None:
        self._replays[client] -= 1
        if not self._replays[client]:
            del self._replays[client]

    # -- the sweep ------------------------------------------------------------------------------
    def start(self) -> None:
        self._sweeper = asyncio.ensure_future(self._sweep())

    async def close(self) -> None:
        """Stop the sweep and the workers (the server is stopping; Redis is still up): each
        response still running fails now, with `response.failed` last among its events."""
        self._closing = True
        tasks = [t for t in (self._sweeper, *self.workers.values()) if t is not None]
        for t in tasks:
            t.cancel()
        if not tasks:
            return
        # bounded: a worker whose generation does not take the cancel at once (it can land
        # where the run's events go on) must not hold the server's stop forever; the engine
        # stops next, which ends its run, and the worker then fails its response
        _, pending = await asyncio.wait(tasks, timeout=CLOSE_WAIT)
        if pending:
            log.warning("%d background responses still stopping; the engine's stop ends them", len(pending))

    async def _sweep(self) -> None:
        """Sweep every half lease. Redis away: one line when it goes (never a traceback),
        then quiet retries, and one line when it answers again."""
        away = False
        while True:
            await asyncio.sleep(self.lease / 2)
            try:
                await self.sweep()
            except StoreError as exc:
                if not away:
                    log.warning(
                        "cannot sweep the background responses' leases, retrying every %g s: %s",
                        self.lease / 2, exc,
                    )  # fmt: skip
                away = True
                continue
            if away:
                log.info("the sweep of the background responses' leases runs again")
                away = False

    async def sweep(self) -> None:
        """Fail each background response whose worker's lease lapsed, and delete the session
        its run made (see the module)."""
        due, count = await self.store.lease("due")
        metrics.RESPONSES_BACKGROUND_QUEUED.set(count)
        for response_id in due:
            found = await self.store.expire(response_id, DIED)
            if found.status == "alive":  # (a live worker's next renewal moves it on in the register)
                continue
            if found.status == "failed":
                metrics.RESPONSES.labels("failed").inc()
                log.warning("background response %s failed: its worker's lease lapsed", response_id)
                await self._account(response_id, found.owner)
            if found.orphan and not await self.responses.release(found.owner, found.orphan):
                continue  # the dead worker's lock on it has not lapsed yet: the next sweep
            await self.store.lease("drop", response_id)


async def _through_stalls(store: ResponseStore, write: Callable[[str], Awaitable[bool]]) -> bool:
    """A worker's write, `write(op)`, carried through a Redis stall or a lost connection of
    up to `RIDE_OUT` seconds rather than failing the response: retried with the same op id,
    which the write's script recognises as its own first run (stored.lua's `done`), and
    only once Redis answers a PING, so that a first run a stalled Redis still held queued
    (sent before the stall ended, on a connection of its own) has run before the retry.
    Past `RIDE_OUT`, its error stands: the response fails, as a lapsed lease would."""
    op, deadline, pause = new_op_id(), time.monotonic() + RIDE_OUT, 0.05
    while True:
        try:
            return await write(op)
        except StoreUnavailable as exc:  # (OutcomeUnknown too: it may have run, and the retry knows)
            error = exc
        while True:
            if time.monotonic() + pause > deadline:
                raise error
            await asyncio.sleep(pause)
            pause = min(2 * pause, 1.0)
            try:
                await store.connection.ping()
                break
            except StoreUnavailable:
                continue
