"""The store: the only part of recur that knows Redis, its key schema and its scripts.

Split the way the data is split (app/store/keys.py has the schema):

- `connection.py`: where Redis is (one server, a Cluster, Sentinels), the one client, the
  scripts' runner and failover, and the storage guard's reading of Redis's memory;
- `scripts.py` and `lua/`: the Lua scripts, one file each, registered once; they answer
  field/value pairs that Python reads by name;
- `sessions.py`: a session's keys (`{F}`, its family's tag: its forks' too): create, read, the kept versions, the writer
  lock and the fenced commit;
- `tenants.py`: a tenant's keys (`{T}`): the quota ledger, the token buckets, the prefix
  index;
- `responses.py`: a stored response's keys (`{resp_…}`) and a conversation's (`{conv_…}`)
  of the Responses and Conversations APIs, and the register of background workers' leases;
- `records.py`: a response's and a conversation's records, typed, with `to_fields` /
  `from_fields`;
- `types.py`: what the store hands out and raises.

No script touches a session's keys and a tenant's together, so each runs on one Redis
Cluster slot. This package knows nothing of HTTP, tensors or the model.
"""

from __future__ import annotations

from app.config import Settings

from .connection import CLIENT_NAME, Connection, parse_redis_url
from .keys import Keys, fork_id, response_id
from .records import ConversationRecord, ResponseRecord
from .responses import ResponseStore, Walk, new_object_id, new_op_id
from .sessions import SessionStore, Writer
from .tenants import TenantStore
from .types import (
    AtVersion,
    CommitConflict,
    LedgerTotals,
    ObjectNotFound,
    OutcomeUnknown,
    QuotaExceeded,
    SessionBusy,
    SessionMeta,
    SessionNotFound,
    StateBlobs,
    StorageFull,
    StoreError,
    StoreUnavailable,
    Version,
    VersionGone,
    VersionMismatch,
    new_session_id,
    owner_of,
    tenant_of,
)

__all__ = [
    "CLIENT_NAME",
    "AtVersion",
    "CommitConflict",
    "Connection",
    "ConversationRecord",
    "Keys",
    "ObjectNotFound",
    "OutcomeUnknown",
    "QuotaExceeded",
    "ResponseRecord",
    "ResponseStore",
    "SessionBusy",
    "SessionMeta",
    "SessionNotFound",
    "SessionStore",
    "StateBlobs",
    "StorageFull",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "TenantStore",
    "LedgerTotals",
    "Version",
    "VersionGone",
    "VersionMismatch",
    "Writer",
    "new_object_id",
    "new_op_id",
    "new_session_id",
    "fork_id",
    "response_id",
    "Walk",
    "owner_of",
    "parse_redis_url",
    "tenant_of",
]


class Store:
    """The store's rooms over one connection, as `Settings` describe them."""

    def __init__(
        self, connection: Connection, keys: Keys, *, lock_lease_seconds: float, transcript_max_bytes: int
    ):
        self.connection = connection
        self.sessions = SessionStore(
            connection, keys, lock_lease_seconds=lock_lease_seconds, transcript_max_bytes=transcript_max_bytes
        )
        self.tenants = TenantStore(connection, keys)
        self.responses = ResponseStore(connection, keys)

    @classmethod
    def from_settings(cls, settings: Settings) -> Store:
        if not settings.redis_url:
            raise ValueError("the store needs settings.redis_url (recur serve starts an embedded Redis)")
        connection = Connection(
            settings.redis_url, timeout=settings.redis_timeout, max_connections=settings.redis_max_connections
        )
        return cls(
            connection,
            Keys(settings.key_prefix),
            lock_lease_seconds=settings.lock_lease_seconds,
            transcript_max_bytes=int(settings.transcript_max_kb * 1024),
        )

    async def ping(self) -> None:
        await self.connection.ping()

    async def close(self) -> None:
        await self.connection.close()
