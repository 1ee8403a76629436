"""Tenant accounting: admission, reservation, settlement and usage, and their metrics.

The sessions service calls this room at the start and at the end of a transaction, never
in its middle:

- **admission**: the tenant's request rate (`check_rate`, every /v1 request), and a
  generation's start (`starting`): a place among its client's streams on this replica, and
  the tokens it may draw reserved in the tenant's bucket, so concurrent requests cannot
  overdraw it;
- **reservation**: a new session's place (`admit_session`, before any model time is spent)
  and its bytes (`reserve`, before it is written), checked in the tenant's ledger in Redis
  (shared by every replica) and against Redis's headroom (the storage guard); a commit that
  grows a session (`reserve_growth`) is checked against this replica's last reading of the
  tenant's ledger while the tenant is well within its byte quota (no round trip), and in
  the ledger itself once it is near it (the last `STRICT_MARGIN` of it);
- **settlement** (`settle`, after a write): the ledger takes the session as the write left
  it (its bytes and its expiry) and the prefix index its state, in one round trip;
  `touch` follows a read that re-armed a session's expiry; `forget` a delete.

A tenant is an API key (its owner hash); without keys, every client is the one tenant
`open`. This module knows neither HTTP nor tensors.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from app import metrics, prefixes
from app.config import Quota
from app.store import (
    LedgerTotals,
    QuotaExceeded,
    SessionMeta,
    StorageFull,
    StoreUnavailable,
    TenantStore,
    tenant_of,
)
from app.store.connection import Connection
from app.store.tenants import LISTING_CURSOR as LISTING_CURSOR  # (the API checks a listing cursor)
from app.store.tenants import Kept

T = TypeVar("T")
log = logging.getLogger("recur.tenants")

# a growing commit is checked in the ledger itself once the tenant's bytes are within this
# share of its quota; below, against this replica's last reading of the ledger
STRICT_MARGIN = 0.1

# The client a request serves, for the engine's fairness and the stream limit: its API key's
# owner, or (without keys, where every client is one tenant) its address. Set by the API
# for each request (`app.api.http.deps.bind_client`), as the log context is.
CLIENT: contextvars.ContextVar[str] = contextvars.ContextVar("recur_client", default="")

# how long a place held for a request's new sessions (`Tenants.places`) counts, if the
# replica that held it dies before giving it back
PLACE_TTL = 120.0


@dataclasses.dataclass
class _Places:
    """The places held for the request this context serves (`Tenants.places`), not yet taken."""

    owner: str
    free: list[str]


PLACES: contextvars.ContextVar[_Places | None] = contextvars.ContextVar("recur_places", default=None)


class Pace:
    """Each client's bytes a second on this replica for one costly kind of transfer
    (replays of background responses' events, state imports), paced (the generic cell rate
    algorithm): a client may move `burst` seconds' worth at once, then waits as long as its
    bytes take at `rate`. So one client moving state in a loop leaves the replica's cores to
    the others. 0 = no limit."""

    def __init__(self, rate: float, burst: float = 0.5):
        self.rate, self.burst = rate, burst
        self._due: dict[str, float] = {}  # client -> when its bytes so far are paid for

    async def take(self, client: str, nbytes: int) -> None:
        if not self.rate:
            return
        now = time.monotonic()
        due = max(now, self._due.get(client, now)) + nbytes / self.rate
        self._due[client] = due
        if len(self._due) > 4096:  # (clients long paid up are forgotten)
            self._due = {c: t for c, t in self._due.items() if t > now}
        if due - now > self.burst:
            await asyncio.sleep(due - now - self.burst)


class Tenants:
    def __init__(
        self,
        store: TenantStore,
        connection: Connection,
        *,
        quota: Quota,
        quotas: dict[str, Quota],
        max_streams: int,
    ):
        self.store = store
        self.connection = connection  # (its reading of Redis's memory: the storage guard)
        self.quota = quota  # every tenant's but those in `quotas` (by owner)
        self.quotas = quotas
        self.max_streams = max_streams  # generations one client may run at once on this replica
        self._streams: collections.Counter[str] = collections.Counter()
        self._totals: dict[str, LedgerTotals] = {}  # each tenant's ledger, as last seen here

    def quota_of(self, owner: str) -> Quota:
        return self.quotas.get(owner, self.quota)

    # -- admission ----------------------------------------------------------------------------
    async def check_rate(self, owner: str) -> None:
        """The tenant's request rate, shared by all replicas: QuotaExceeded past it."""
        metrics.TENANT_REQUESTS.labels(tenant_of(owner)).inc()
        await self._counted(owner, self.store.take_request(owner, self.quota_of(owner)))

    @contextlib.asynccontextmanager
    async def starting(self, owner: str, runs: int, max_tokens: int) -> AsyncIterator[Callable[[Any], None]]:
        """Admit a request that starts `runs` generations of up to `max_tokens` each: a place
        for each among its client's streams on this replica (QuotaExceeded past
        `max_streams`, before any work), and their tokens reserved in the tenant's bucket
        (QuotaExceeded while it is in debt). If starting them fails, both are given back.
        Yields `admitted`, to call on each run once all have started: each gives back its
        place, and the tokens it did not draw, when it ends (`ended`)."""
        client = CLIENT.get()
        if self._streams[client] + runs > self.max_streams:
            raise QuotaExceeded(
                "streams",
                f"this client runs {self._streams[client]} generations on this server, its limit of "
                f"{self.max_streams}; retry when one has ended",
                1,
            )
        quota = self.quota_of(owner)
        self._streams[client] += runs
        try:
            await self._counted(owner, self.store.reserve_tokens(owner, quota, runs * max_tokens))
            try:
                yield lambda run: run.admitted(client, max_tokens)
            except BaseException:
                with contextlib.suppress(StoreUnavailable):  # (lost, the tokens only stay reserved)
                    await self.store.refund_tokens(owner, quota, runs * max_tokens)
                raise
        except BaseException:
            self._streams[client] -= runs
            raise

    async def ended(self, owner: str, client: str | None, reserved: int, used: int) -> None:
        """A generation admitted by `starting` has ended, having drawn `used` tokens: its
        place among its client's streams is free, its tokens count against its tenant, and
        what it reserved and did not draw goes back."""
        if client is not None:
            self._streams[client] -= 1
            if not self._streams[client]:
                del self._streams[client]
        metrics.TENANT_GENERATED_TOKENS.labels(tenant_of(owner)).inc(used)
        await self.store.refund_tokens(owner, self.quota_of(owner), reserved - used)

    # -- reservation --------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def places(self, owner: str, count: int) -> AsyncIterator[None]:
        """Hold `count` places in the tenant's session quota, all or none (QuotaExceeded),
        for the new sessions a request will make within this block: each new session the
        block's tasks admit takes one. Without it, requests racing for a tenant's last places
        each took some and then all failed (issue 39: n=2 at the edge served none). What the
        block did not take is given back at its end. One place needs no hold: a single
        admission is one step already."""
        if count <= 1:
            yield
            return
        self._check_headroom()
        quota = self.quota_of(owner)
        ids = [f"place:{uuid.uuid4().hex}:{i}" for i in range(count)]
        self._seen(
            owner, await self._counted(owner, self.store.hold(owner, ids, time.time() + PLACE_TTL, quota))
        )
        held = _Places(owner, ids)
        token = PLACES.set(held)
        try:
            yield
        finally:
            PLACES.reset(token)
            if held.free:
                try:  # (lost, they count until PLACE_TTL passes)
                    self._seen(owner, await self.store.release(owner, held.free))
                except StoreUnavailable:
                    log.warning("could not give back %d places held in a tenant's ledger", len(held.free))

    async def admit_session(self, owner: str, session_id: str, ttl: float, ephemeral: bool = False) -> None:
        """A new session's place in its tenant's ledger, before any model time is spent: within
        the tenant's session quota and Redis's headroom (QuotaExceeded, StorageFull)."""
        await self.reserve(owner, session_id, 0, ttl, ephemeral)

    async def reserve(
        self, owner: str, session_id: str, state_bytes: int, ttl: float, ephemeral: bool = False
    ) -> None:
        """Enter a session's size in its tenant's ledger before writing it, only within the
        tenant's quota and Redis's headroom (QuotaExceeded, StorageFull). A new session enters
        the tenant's listing, hidden by default when `ephemeral` (made for one request)."""
        self._check_headroom()
        quota = self.quota_of(owner)
        expiry = time.time() + ttl
        held = PLACES.get()
        place = held.free.pop() if held is not None and held.owner == owner and held.free else ""
        placed = False
        try:
            recorded = self.store.record(owner, session_id, state_bytes, expiry, quota, ephemeral, place)
            totals, placed = await self._counted(owner, recorded)
        finally:
            if place and not placed:  # (still held, or its fate unknown: given back at the end)
                held.free.append(place)  # type: ignore[union-attr]
        self._seen(owner, totals)

    async def reserve_growth(self, owner: str, old: SessionMeta, state_bytes: int) -> None:
        """Before a commit makes session `old` hold `state_bytes`: nothing to check if it does
        not grow; against this replica's last reading of the tenant's ledger while the
        tenant stays below its quota's last `STRICT_MARGIN`; else in the ledger itself."""
        growth = state_bytes - old.stored_bytes
        if growth <= 0:
            return
        self._check_headroom()
        quota, seen = self.quota_of(owner), self._totals.get(owner)
        if seen is not None and seen.state_bytes + growth <= (1 - STRICT_MARGIN) * quota.state_bytes:
            return
        await self.reserve(owner, old.id, state_bytes, old.ttl)

    def _check_headroom(self) -> None:
        if self.connection.memory_full:
            raise StorageFull("Redis is nearly full: new sessions and growing ones wait until it has room")

    # -- settlement ---------------------------------------------------------------------------
    async def settle(self, owner: str, meta: SessionMeta, index: bool) -> SessionMeta:
        """After a write: the ledger takes the session as the write left it (its size: the
        history and transcript bounds may have made it smaller than reserved; its expiry, as
        Redis set it) and, with `index`, the prefix index its state, in one round trip (best
        effort for the index: a lost entry costs a prefill)."""
        index = index and meta.tokens_hash != prefixes.UNKNOWN and meta.n_tokens >= 2
        self._seen(owner, await self.store.settle(owner, meta, index))
        return meta

    async def settled(self, owner: str, meta: SessionMeta, index: bool) -> SessionMeta:
        """`settle` after a write that has happened: best effort, as `touch`. The write's
        answer is its truth, and a ledger Redis did not answer for must not turn it into a
        failure; the session's next write settles it again."""
        try:
            return await self.settle(owner, meta, index)
        except StoreUnavailable:
            log.warning("could not settle session %s in its tenant's ledger", meta.id)
            return meta

    async def settle_kept(
        self, owner: str, meta: SessionMeta, index: bool, object_id: str, nbytes: int, ttl: float
    ) -> SessionMeta:
        """`settle` after a write whose session an object keeps (a stored response, whose
        commit deferred its settlement to here): the object's `nbytes` enter the ledger
        with the session, in one round trip, within the tenant's quota and Redis's headroom
        (QuotaExceeded, StorageFull: the session's entry is settled all the same)."""
        try:
            self._check_headroom()
        except StorageFull:
            await self.settled(owner, meta, index)
            raise
        kept = Kept(object_id, nbytes, time.time() + ttl, self.quota_of(owner))
        self._seen(owner, await self._counted(owner, self.store.settle(owner, meta, index, kept)))
        return meta

    async def touch(self, owner: str, meta: SessionMeta) -> None:
        """A read re-armed the session's expiry: the ledger follows. Best effort: a read never
        fails for the ledger (in a Cluster it lives on another primary than the session); a
        replica that dies, or a tenant's primary that does not answer, between the two leaves
        the previous expiry until the next use."""
        try:
            await self.settle(owner, meta, index=False)
        except StoreUnavailable:
            log.warning("could not record a use of session %s in its tenant's ledger", meta.id)

    async def recorded(self, owner: str, object_id: str, nbytes: int, ttl: float) -> None:
        """Enter what was written without a reservation (a stopped background response's
        record and events: written as it ran, and kept for `ttl`): unchecked, since it is
        there either way, and best effort, as `settled`."""
        try:
            self._seen(owner, (await self.store.record(owner, object_id, nbytes, time.time() + ttl, None))[0])
        except StoreUnavailable:
            log.warning("could not record %s in its tenant's ledger", object_id)

    async def forget(self, owner: str, session_id: str) -> None:
        """A deleted session, or one a failed write never made, leaves the ledger."""
        self._seen(owner, await self.store.forget(owner, session_id))

    async def forgotten(self, owner: str, object_id: str) -> None:
        """`forget` after a delete that has happened: best effort, as `settled` (an entry
        left behind leaves the ledger when its expiry passes)."""
        try:
            await self.forget(owner, object_id)
        except StoreUnavailable:
            log.warning("could not take %s out of its tenant's ledger", object_id)

    async def usage(self, owner: str) -> LedgerTotals:
        return self._seen(owner, await self.store.usage(owner))

    # -- the listing and the prefix index: the tenant's other keys, through this door too --------
    async def listing(
        self, owner: str, cursor: str, count: int, ephemeral: bool
    ) -> tuple[list[tuple[str, bool]], str]:
        """A page of the tenant's sessions, newest first (`TenantStore.listing`)."""
        return await self.store.listing(owner, cursor, count, ephemeral)

    async def find_prefix(self, owner: str, hashes: list[str]) -> tuple[int, str, int] | None:
        """The longest of `hashes` the tenant has a committed state of (`TenantStore.find_prefix`)."""
        return await self.store.find_prefix(owner, hashes)

    async def unindex(self, owner: str, session_id: str, hashes: list[str]) -> None:
        """A deleted session's states leave the prefix index (`TenantStore.unindex`)."""
        await self.store.unindex(owner, session_id, hashes)

    # -- metrics ------------------------------------------------------------------------------
    async def _counted(self, owner: str, pending: Awaitable[T]) -> T:
        try:
            return await pending
        except QuotaExceeded as exc:
            metrics.QUOTA_REFUSALS.labels(tenant_of(owner), exc.limit).inc()
            raise

    def _seen(self, owner: str, totals: LedgerTotals) -> LedgerTotals:
        self._totals[owner] = totals
        tenant = tenant_of(owner)
        metrics.TENANT_SESSIONS.labels(tenant).set(totals.sessions)
        metrics.TENANT_STATE_BYTES.labels(tenant).set(totals.state_bytes)
        return totals
