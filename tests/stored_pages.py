"""A session's stored state as Redis holds it, read and planted with redis-py alone (the key
schema in app/store/keys.py; not the store's scripts): the tests' own view of the pages.

A session's `state` field and its deltas list name pages by id; each page is a string at
`P pages:{F}:ID`, and the family's hash `P pages:{F}` counts each page's names.
"""

from __future__ import annotations

import redis

from app.store import Keys


def page_key(keys: Keys, session_id: str, page_id: bytes | str) -> str:
    pid = page_id.decode() if isinstance(page_id, bytes) else page_id
    return f"{keys.pages(session_id)}:{pid}"


def state_pages(r: redis.Redis, keys: Keys, session_id: str) -> list[bytes]:
    """The ids of the pages of the session's current state: its snapshot's, then its deltas'."""
    snapshot = r.hget(keys.session(session_id), "state")
    assert snapshot is not None, f"session {session_id} is gone from Redis"
    return [snapshot, *r.lrange(keys.deltas(session_id), 0, -1)]


def state_blobs(r: redis.Redis, keys: Keys, session_id: str) -> tuple[bytes, list[bytes]]:
    """The session's current snapshot and deltas, as stored."""
    blobs = []
    for pid in state_pages(r, keys, session_id):
        blob = r.get(page_key(keys, session_id, pid))
        assert blob is not None, f"page {pid!r} of session {session_id} is missing"
        blobs.append(blob)
    return blobs[0], blobs[1:]


def stored_bytes(r: redis.Redis, keys: Keys, session_id: str) -> int:
    """The bytes of the session's current state: its pages' lengths."""
    return sum(int(r.strlen(page_key(keys, session_id, pid))) for pid in state_pages(r, keys, session_id))


def plant(
    r: redis.Redis, keys: Keys, session_id: str, *, snapshot: bytes | None = None, delta: bytes | None = None
) -> None:
    """Put `snapshot` (replacing the deltas) or `delta` (appended) into the session's state
    as a page of its own, as another writer's commit would."""
    pid = f"planted-{r.incr('test:planted')}"
    r.set(page_key(keys, session_id, pid), snapshot if snapshot is not None else delta or b"")
    r.hincrby(keys.pages(session_id), pid, 1)
    if snapshot is not None:
        r.delete(keys.deltas(session_id))
        r.hset(
            keys.session(session_id),
            mapping={"state": pid, "snapshot_bytes": len(snapshot), "delta_bytes": 0},
        )
    else:
        r.rpush(keys.deltas(session_id), pid)


def loose_pages(r: redis.Redis, keys: Keys) -> list[str]:
    """Pages that Redis's expiry would never reclaim, or counts that name none: a page key
    with no TTL, a page no family counts, a count of a page that is gone or of none. Empty:
    every page is counted and goes by count or by time."""
    out = []
    for raw in r.scan_iter(f"{keys.prefix}pages:*", count=1000):
        key = raw.decode()
        if key.endswith("}"):  # a family's counts
            for pid, n in r.hgetall(key).items():
                if int(n) <= 0 or not r.exists(f"{key}:{pid.decode()}"):
                    out.append(
                        f"{key} counts {pid.decode()} as {int(n)}, page there: {r.exists(f'{key}:{pid.decode()}')}"
                    )
            continue
        family, pid = key.rsplit(":", 1)
        if r.ttl(key) == -1:
            out.append(f"{key} has no TTL")
        if not r.hexists(family, pid):
            out.append(f"{key} is counted nowhere")
    return out
