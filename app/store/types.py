"""What the store hands out and raises: sessions' and tenants' records, and the errors.

Values only: no Redis here. A script's answer is field/value pairs (app/store/lua/), read
by name (`fields`); `SessionMeta.from_fields` reads a session's metadata by its own field
names, which the Lua `meta()` returns, so a new field is one edit per language
(tests/app/test_store_contract.py checks the two lists are the same).
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from dataclasses import dataclass, field
from typing import Any

from app.logs import clip


class StoreError(Exception):
    """Base of the store's errors."""


class SessionNotFound(StoreError):
    def __init__(self, session_id: str):
        super().__init__(f"session {clip(session_id)!r} does not exist (never created, deleted, or expired)")


class ObjectNotFound(StoreError):
    """A response, a conversation or a conversation's item that does not exist for this
    owner (never made, deleted, expired, or another tenant's)."""

    def __init__(self, kind: str, object_id: str):
        self.kind = kind
        super().__init__(f"{kind} {clip(object_id)!r} does not exist (never stored, deleted, or expired)")


class SessionBusy(StoreError):
    def __init__(self, session_id: str, retry_after: float):
        self.retry_after = retry_after  # seconds until the holder's lease runs out, at most
        super().__init__(
            f"session {clip(session_id)!r} is busy with another request; retry when it has finished "
            f"(its lock lapses within {retry_after:.1f} s if its holder died)"
        )


class VersionMismatch(StoreError):
    def __init__(self, session_id: str, expected: int, actual: int):
        self.expected, self.actual = expected, actual
        super().__init__(f"session {session_id!r} is at version {actual}, not {expected} (If-Match)")


class VersionGone(StoreError):
    def __init__(self, session_id: str, version: int, oldest: int):
        self.oldest = oldest
        super().__init__(
            f"session {session_id!r} no longer keeps version {version} (or never had it): "
            f"the oldest it keeps is {oldest}"
        )


class CommitConflict(StoreError):
    def __init__(self, session_id: str, expected: int, actual: int | None):
        super().__init__(
            f"session {session_id!r} changed while this request ran (expected version {expected}, "
            f"found {'none: it was deleted' if actual is None else actual}); nothing was committed"
        )


class StoreUnavailable(StoreError):
    """Redis cannot be reached or did not answer in time."""


class OutcomeUnknown(StoreUnavailable):
    """A write was sent and Redis did not answer (a timeout, a lost connection): it may
    have happened or not, and may still happen, as a command a stalled Redis had queued
    runs when the stall ends. Never reported as "nothing changed": the message names what
    to read to find out."""

    def __init__(self, what: str, check: str):
        super().__init__(
            f"Redis did not answer in time: {what} may or may not have happened; {check}, "
            "then retry if it did not"
        )


class QuotaExceeded(StoreError):
    """The tenant is at one of its limits (`limit`: sessions, bytes, requests, tokens, streams);
    nothing was written. `retry_after`: seconds until a rate limit would let it through."""

    def __init__(self, limit: str, message: str, retry_after: float):
        self.limit = limit
        self.retry_after = retry_after
        super().__init__(message)


class StorageFull(StoreError):
    """Redis is near its maxmemory: new sessions and growing commits wait until it has room."""


def fields(raw: list[Any]) -> dict[str, Any]:
    """A script's answer, field/value pairs, by name (names decoded; values as Redis gave them)."""
    return {_text(raw[i]): raw[i + 1] for i in range(0, len(raw), 2)}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


_CONVERT = {"int": lambda v: int(_text(v)), "float": lambda v: float(_text(v)), "str": _text}


@dataclass(frozen=True)
class SessionMeta:
    id: str
    version: int
    n_tokens: int
    model: str
    fingerprint: str
    created_at: float
    expires_at: float
    ttl: int
    snapshot_bytes: int  # size of the stored snapshot
    delta_bytes: int  # total size of the deltas stored after it
    commit_id: str  # random id of the commit that wrote the current state (never reused)
    history_bytes: int  # the kept past versions' blobs and the transcript
    keep_versions: int  # how many versions stay readable, the current one included
    tokens_hash: str  # identifies the tokens the state consumed (`app.prefixes`; '' unknown)

    @classmethod
    def from_fields(cls, session_id: str, raw: list[Any]) -> SessionMeta:
        """The metadata a script's `meta()` answered, read by this class's field names."""
        given = fields(raw)
        values: dict[str, Any] = {
            f.name: _CONVERT[str(f.type)](given[f.name]) for f in dataclasses.fields(cls) if f.name != "id"
        }
        return cls(id=session_id, **values)

    @property
    def state_bytes(self) -> int:
        """The current state's stored bytes: its snapshot and deltas."""
        return self.snapshot_bytes + self.delta_bytes

    @property
    def stored_bytes(self) -> int:
        """Everything the session stores, history and transcript included: what its
        tenant's quota counts."""
        return self.state_bytes + self.history_bytes


@dataclass(frozen=True)
class StateBlobs:
    """A session's stored state: a snapshot and the deltas committed after it, in order."""

    snapshot: bytes
    deltas: tuple[bytes, ...] = ()

    @property
    def nbytes(self) -> int:
        return len(self.snapshot) + sum(len(d) for d in self.deltas)

    @classmethod
    def of(cls, answer: dict[str, Any]) -> StateBlobs | None:
        """The state bytes a script's answer holds, or None (the caller held the current commit)."""
        if answer.get("snapshot") is None:
            return None
        return cls(bytes(answer["snapshot"]), tuple(bytes(d) for d in answer["deltas"]))


@dataclass(frozen=True)
class Version:
    """A kept version of a session: readable, forkable, restorable."""

    version: int
    n_tokens: int
    committed_at: float


@dataclass(frozen=True)
class AtVersion:
    """A session (`meta`, its current version) as it was at a kept version."""

    meta: SessionMeta
    version: Version
    state: StateBlobs | None  # when asked for
    transcript: list[bytes] | None  # the packed segments, oldest first, when asked for
    trimmed: bool = False  # the transcript's oldest segments were dropped (its size bound)
    tokens_hash: str = ""  # the version's (`app.prefixes`; '' unknown)
    state_bytes: int = 0  # the stored bytes of its state (its snapshot and deltas)


@dataclass(frozen=True)
class LedgerTotals:
    """What a tenant holds in Redis now: its entries (its live sessions, and its stored
    responses and conversations, which count against the same limit) and their stored
    bytes; `kinds`, when read (`TenantStore.usage`), splits them: kind -> (count, bytes)."""

    sessions: int
    state_bytes: int
    kinds: dict[str, tuple[int, int]] = field(default_factory=dict)

    @classmethod
    def of(cls, answer: dict[str, Any]) -> LedgerTotals:
        split = [bytes(x).decode() if isinstance(x, bytes) else x for x in answer.get("kinds", [])]
        kinds = {str(split[i]): (int(split[i + 1]), int(split[i + 2])) for i in range(0, len(split), 3)}
        return cls(int(answer["sessions"]), int(answer["state_bytes"]), kinds)


def owner_of(key: str) -> str:
    """The tenant a key stands for, as stored with its sessions: a hash, never the key."""
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def tenant_of(owner: str) -> str:
    """A tenant's id in key names and metrics: 96 bits of its owner hash (`open` without keys)."""
    return owner.removeprefix("sha256:")[:24] or "open"


def new_session_id() -> str:
    return secrets.token_hex(16)


def new_commit_id() -> str:
    """Names one committed state. Versions can repeat if Redis loses a commit (the next
    commit reuses the number for other content); 64 random bits never do, so a hot cache
    keyed by commit id can never mistake a lost state for the current one."""
    return secrets.token_hex(8)
