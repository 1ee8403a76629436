"""Tenants in Redis: each tenant's ledger, token buckets and prefix index, on its own keys
(`{T}`, never a session's: each script here touches one slot, and runs beside, never
inside, the session script it follows).

The ledger: a tenant's live sessions by expiry (a sorted set) and their stored bytes (a
hash with `_total`), which its quotas are checked against. `record` enters a session's
size, refusing it past the tenant's limits when asked to check; `settle` enters it after a
write, and the prefix index entry of the state the write committed, in one round trip.
The buckets: requests and generated tokens per second, refilled from the Redis clock. The
prefix index: a committed state's "session_id:version" by the hash of its tokens
(app/prefixes.py), for the tenant's requests without a session to fork.
"""

from __future__ import annotations

from dataclasses import dataclass

from app.config import Quota

from .connection import Connection
from .keys import Keys, entry_kind
from .types import LedgerTotals, QuotaExceeded, SessionMeta, fields, tenant_of

# a listing's cursor: '0' (the first page), or a page's own: the microseconds and the entry
# it ended at ('0' a session, '1' an ephemeral one, then the id: a fork's is 49 characters)
LISTING_CURSOR = r"^(0|[0-9]{1,17}[01][0-9a-f]{32}(\.[0-9a-f]{16})?)$"


@dataclass(frozen=True)
class Kept:
    """An object a write was for (a stored response's record), entered in its tenant's
    ledger with the write's settlement: its id, bytes, expiry (unix s) and the limits it
    must stay within."""

    id: str
    nbytes: int
    expires_at: float
    limits: Quota


def _refused(status: bytes, usage: LedgerTotals, nbytes: int, limits: Quota) -> None:
    """The QuotaExceeded a ledger script's refusal (`status`) stands for, if any."""
    if status == b"sessions":
        raise QuotaExceeded(
            "sessions", f"this key holds {usage.sessions} sessions, its limit; delete some first", 60
        )
    if status == b"bytes":
        raise QuotaExceeded(
            "bytes",
            f"this key's sessions hold {usage.state_bytes} bytes of state; {nbytes} more would "
            f"pass its limit of {limits.state_bytes}: delete sessions first",
            60,
        )


class TenantStore:
    def __init__(self, connection: Connection, keys: Keys):
        self.connection = connection
        self.keys = keys

    # -- the ledger ---------------------------------------------------------------------------
    async def record(
        self,
        owner: str,
        entry: str,
        state_bytes: int,
        expires_at: float,
        limits: Quota | None,
        ephemeral: bool = False,
        place: str = "",
    ) -> tuple[LedgerTotals, bool]:
        """Enter a ledger entry's stored size and expiry in its tenant's ledger: `entry` is
        a session's id, or a stored object's (`entry_kind`). With `limits`, only if the
        tenant stays within them (else QuotaExceeded, and nothing changes). A new session
        enters the listing too, `ephemeral` (hidden by default) or not, and takes `place`
        (one `hold` made for it) if that is still held. Returns the tenant's totals, and
        whether it took the place."""
        check = ["1", limits.sessions, limits.state_bytes] if limits else ["0", 0, 0]
        listed = ("e" if ephemeral else "s") if entry_kind(entry) == "session" else ""  # (objects: unlisted)
        args = [entry, int(state_bytes), f"{expires_at:.3f}", *check, listed, place]
        answer = fields(await self.connection.run("record", self.keys.ledger(tenant_of(owner)), args))
        usage = LedgerTotals.of(answer)
        if limits:
            _refused(answer["status"], usage, state_bytes, limits)
        return usage, answer["placed"] == b"1"

    async def hold(self, owner: str, places: list[str], expires_at: float, limits: Quota) -> LedgerTotals:
        """Hold `places` in the tenant's ledger, all of them or none (QuotaExceeded): one for
        each new session a request will make, so that requests racing for the last places
        cannot each take some and all fail. A place counts as a session until `record`
        turns it into one, `release` gives it back, or `expires_at` passes."""
        args = [f"{expires_at:.3f}", limits.sessions, *places]
        answer = fields(await self.connection.run("hold", self.keys.ledger(tenant_of(owner)), args))
        usage = LedgerTotals.of(answer)
        if answer["status"] == b"sessions":
            raise QuotaExceeded(
                "sessions",
                f"this key holds {usage.sessions} sessions; this request needs {len(places)} more, past its "
                f"limit of {limits.sessions}: delete some first",
                60,
            )
        return usage

    async def release(self, owner: str, places: list[str]) -> LedgerTotals:
        """Give back the places of a `hold` that no session took."""
        answer = await self.connection.run("hold", self.keys.ledger(tenant_of(owner)), ["0", 0, *places])
        return LedgerTotals.of(fields(answer))

    async def settle(
        self, owner: str, meta: SessionMeta, index: bool, kept: Kept | None = None
    ) -> LedgerTotals:
        """After a write: the session's size and expiry as the write left them and, with
        `index`, its state in the prefix index (until the session would expire), in one step;
        with `kept`, the object the write was for (a stored response's record) enters the
        ledger in the same step, only within the tenant's limits (else QuotaExceeded: the
        session's entry stands, the object's is not made)."""
        tenant = tenant_of(owner)
        keys = self.keys.ledger(tenant)
        if index:
            keys.append(self.keys.prefix_entry(tenant, meta.tokens_hash))
        args: list[str | int] = [
            meta.id, meta.stored_bytes, f"{meta.expires_at:.3f}", f"{meta.id}:{meta.version}", meta.ttl
        ]  # fmt: skip
        if kept is not None:
            args += [
                kept.id,
                kept.nbytes,
                f"{kept.expires_at:.3f}",
                kept.limits.sessions,
                kept.limits.state_bytes,
            ]
        answer = fields(await self.connection.run("settle", keys, args))
        usage = LedgerTotals.of(answer)
        if kept is not None:
            _refused(answer["status"], usage, kept.nbytes, kept.limits)
        return usage

    async def forget(self, owner: str, entry: str) -> LedgerTotals:
        """A deleted session (or stored object: `entry` is its id) leaves its tenant's ledger."""
        answer = await self.connection.run("forget", self.keys.ledger(tenant_of(owner)), [entry])
        return LedgerTotals.of(fields(answer))

    async def usage(self, owner: str) -> LedgerTotals:
        return LedgerTotals.of(
            fields(await self.connection.run("usage", self.keys.ledger(tenant_of(owner)), []))
        )

    async def listing(
        self, owner: str, cursor: str, count: int, ephemeral: bool
    ) -> tuple[list[tuple[str, bool]], str]:
        """A page of the tenant's sessions, newest first (never `KEYS`): (id, ephemeral)
        pairs, and the next page's cursor ('': no more). `cursor` is '' for the first page,
        else a page's own (`LISTING_CURSOR`); `ephemeral` includes the ephemeral sessions.
        A session that lives through the whole listing appears exactly once."""
        top, after = "", ""
        if cursor:
            n = 49 if "." in cursor else 32  # (the id's length: a fork's, or another session's)
            top, after = cursor[: -n - 1], ("e:" if cursor[-n - 1] == "1" else "s:") + cursor[-n:]
        args = [top, after, count, "1" if ephemeral else "0"]
        answer = fields(await self.connection.run("listing", self.keys.ledger(tenant_of(owner)), args))
        ids = [bytes(i).decode() for i in answer["ids"]]
        flags = [bytes(f) == b"1" for f in answer["ephemeral"]]
        top, after = bytes(answer["next"]).decode(), bytes(answer["after"]).decode()
        following = f"{top}{'1' if after.startswith('e:') else '0'}{after[2:]}" if top else ""
        return list(zip(ids, flags, strict=True)), following

    # -- the prefix index ---------------------------------------------------------------------
    async def find_prefix(self, owner: str, hashes: list[str]) -> tuple[int, str, int] | None:
        """The first of `hashes` (longest prefix first) that the owner has indexed: (its
        position in `hashes`, session id, version), or None."""
        if not hashes:
            return None
        tenant = tenant_of(owner)
        raw = await self.connection.run(
            "find_prefix", [self.keys.prefix_entry(tenant, h) for h in hashes], []
        )
        if not raw:
            return None
        answer = fields(raw)
        sid, _, version = bytes(answer["entry"]).decode().partition(":")
        return int(answer["index"]) - 1, sid, int(version)

    async def unindex(self, owner: str, session_id: str, hashes: list[str]) -> None:
        """Drop a deleted session's entries (by its states' token hashes) from the prefix
        index, those it still holds: a session deleted on purpose leaves no entry behind."""
        tenant = tenant_of(owner)
        keys = [self.keys.prefix_entry(tenant, h) for h in dict.fromkeys(hashes) if h]
        if keys:
            await self.connection.run("unindex", keys, [session_id])

    # -- the buckets --------------------------------------------------------------------------
    async def take_request(self, owner: str, limits: Quota) -> None:
        """Take one request from the tenant's request bucket, shared by every replica: else
        QuotaExceeded."""
        if limits.requests_per_second:
            await self._bucket(owner, limits, "request", 0)

    async def reserve_tokens(self, owner: str, limits: Quota, tokens: int) -> None:
        """Reserve the tokens a request's generations may draw from the tenant's token
        bucket, only while it is out of debt: else QuotaExceeded, and nothing is taken."""
        if limits.tokens_per_second:
            await self._bucket(owner, limits, "reserve", tokens)

    async def refund_tokens(self, owner: str, limits: Quota, tokens: int) -> None:
        """Give back reserved tokens a generation did not draw."""
        if limits.tokens_per_second and tokens > 0:
            await self._bucket(owner, limits, "refund", tokens)

    async def _bucket(self, owner: str, limits: Quota, op: str, tokens: int) -> None:
        args = [limits.requests_per_second, limits.tokens_per_second, op, int(tokens)]
        answer = fields(await self.connection.run("bucket", [self.keys.rate(tenant_of(owner))], args))
        status = bytes(answer["status"]).decode()
        if status != "ok":
            what = "requests per second" if status == "requests" else "generated tokens per second"
            limit = limits.requests_per_second if status == "requests" else limits.tokens_per_second
            raise QuotaExceeded(
                status, f"this key is at its limit of {limit:g} {what}", float(answer["retry_after"])
            )
