"""Paged state storage against a real Redis (app/store/lua/session.lua, fork.lua): a fork
names its source's pages instead of copying them, each page lives while a session names
it and goes when the last one lets go, and a session stored before pages moves into them.

Redis is read here with redis-py alone (tests/stored_pages.py), never through the store."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator

import pytest
import redis

from app.config import Settings
from app.store import SessionNotFound, SessionStore, StateBlobs, Store, VersionGone, fork_id
from app.store.keys import family
from tests.conftest import RedisProcess
from tests.stored_pages import loose_pages, page_key, state_blobs

MB = 2**20


def _store(url: str) -> SessionStore:
    return Store.from_settings(Settings(redis_url=url, key_prefix=f"pages-{secrets.token_hex(4)}:")).sessions


def pages_in_redis(r: redis.Redis, store: SessionStore, session_id: str) -> set[str]:
    """Every page key of the session's family that Redis holds."""
    return {k.decode() for k in r.scan_iter(f"{store.keys.pages(session_id)}:*", count=1000)}


def used_memory(r: redis.Redis) -> int:
    return int(r.info("memory")["used_memory"])


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis of this module's own: its byte and memory counters see no other test."""
    server = RedisProcess(tmp_path_factory.mktemp("pages-redis"))
    yield server.url
    server.stop()


def test_a_fork_names_its_sources_pages_and_outlives_it(own_redis):
    r = redis.Redis.from_url(own_redis)

    async def go():
        store = _store(own_redis)
        snapshot, delta = secrets.token_bytes(MB), secrets.token_bytes(64 * 1024)
        src = await store.create(StateBlobs(snapshot, (delta,)), 10, "m", "fp", ttl=60, owner="o", keep=2)
        before_pages = pages_in_redis(r, store, src.id)
        mem0, wrote0 = used_memory(r), int(r.info("stats")["total_net_input_bytes"])
        fork = await store.fork(src.id, 0, "o", fork_id(src.id), ttl=60, keep=2, transcript=[b"seg"])
        wrote = int(r.info("stats")["total_net_input_bytes"]) - wrote0
        grown = used_memory(r) - mem0
        # a manifest, not a copy: well under 2% of the state, in bytes sent and in memory
        assert wrote < 0.02 * (len(snapshot) + len(delta)), wrote
        assert grown < 0.02 * (len(snapshot) + len(delta)), grown
        assert pages_in_redis(r, store, src.id) == before_pages
        assert family(fork.id) == src.id and fork.id != src.id
        assert fork.version == 0 and fork.n_tokens == 10 and fork.state_bytes == len(snapshot) + len(delta)
        assert state_blobs(r, store.keys, fork.id) == (snapshot, [delta])

        # each goes its own way: the source's commits never touch the fork's state
        w = await store.begin(src.id, owner="o")
        await w.commit(11, snapshot=b"replaced")
        w = await store.begin(src.id, owner="o")
        await w.commit(12, snapshot=b"replaced again")  # (version 0's pages leave the history)
        assert (await store.read(fork.id, with_state=True, owner="o"))[1] == StateBlobs(snapshot, (delta,))
        await store.delete(src.id, owner="o")
        assert (await store.read(fork.id, with_state=True, owner="o"))[1] == StateBlobs(snapshot, (delta,))
        # the last name goes: so do the pages, and the family's count of them
        await store.delete(fork.id, owner="o")
        assert pages_in_redis(r, store, src.id) == set()
        assert not r.exists(store.keys.pages(src.id))
        assert not loose_pages(r, store.keys)

    asyncio.run(go())


def test_a_fork_of_a_kept_version_names_its_history_pages(redis_url):
    r = redis.Redis.from_url(redis_url)

    async def go():
        store = _store(redis_url)
        src = await store.create(StateBlobs(b"s0"), 1, "m", "fp", ttl=60, keep=3)
        w = await store.begin(src.id)
        await w.commit(2, delta=b"d1")
        w = await store.begin(src.id)
        await w.commit(3, snapshot=b"s2")  # (versions 0 and 1 now in the history)
        fork = await store.fork(src.id, 1, "", fork_id(src.id), ttl=60, keep=1, transcript=[])
        assert state_blobs(r, store.keys, fork.id) == (b"s0", [b"d1"])
        assert fork.n_tokens == 2
        for _ in range(3):  # the source keeps 3 versions: 0 and 1 leave its history
            w = await store.begin(src.id)
            await w.commit(3, snapshot=b"sN")
        assert (await store.read_at(src.id, None, "")).version.version == 5
        with pytest.raises(VersionGone):
            await store.read_at(src.id, 1, "")
        assert (await store.read(fork.id, with_state=True))[1] == StateBlobs(b"s0", (b"d1",))
        assert not loose_pages(r, store.keys)
        # a version past the kept history, or not the one the caller read, is no fork
        with pytest.raises(VersionGone):
            await store.fork(src.id, 1, "", fork_id(src.id), ttl=60, keep=1, transcript=[])
        with pytest.raises(VersionGone):
            await store.fork(
                src.id, 5, "", fork_id(src.id), ttl=60, keep=1, transcript=[], tokens_hash="other"
            )

    asyncio.run(go())


def test_another_tenant_cannot_fork_or_reach_the_pages(redis_url):
    async def go():
        store = _store(redis_url)
        src = await store.create(StateBlobs(b"secret"), 1, "m", "fp", ttl=60, owner="a")
        with pytest.raises(SessionNotFound):
            await store.fork(src.id, 0, "b", fork_id(src.id), ttl=60, keep=1, transcript=[])
        with pytest.raises(SessionNotFound):
            await store.read(fork_id(src.id), owner="a")  # (a family member that does not exist)

    asyncio.run(go())


def test_a_retried_fork_answers_as_its_first_run_and_names_once(redis_url):
    """The fork's first run happened but its answer was lost: the retry (same commit id)
    answers the same session, and the pages' counts grow once."""
    r = redis.Redis.from_url(redis_url)

    async def go():
        store = _store(redis_url)
        src = await store.create(StateBlobs(b"s0", (b"d1",)), 2, "m", "fp", ttl=60)
        new = fork_id(src.id)
        keys = store.keys.of_session(src.id) + store.keys.of_session(new)[:5]
        args = ["", 0, "", 60, "c" * 32, 1, 1000]
        first = await store.connection.run("fork", keys, args)
        again = await store.connection.run("fork", keys, args)
        assert first == again
        counts = {int(v) for v in r.hvals(store.keys.pages(src.id))}
        assert counts == {2}  # (each page: the source's name and the fork's)

    asyncio.run(go())


def test_pages_live_at_least_as_long_as_every_session_naming_them(redis_url):
    r = redis.Redis.from_url(redis_url)

    async def go():
        store = _store(redis_url)
        src = await store.create(StateBlobs(b"s0"), 1, "m", "fp", ttl=30)
        page = page_key(store.keys, src.id, r.hget(store.keys.session(src.id), "state"))
        assert 0 < r.ttl(page) <= 30
        fork = await store.fork(src.id, 0, "", fork_id(src.id), ttl=600, keep=1, transcript=[])
        assert 30 < r.ttl(page) <= 600 and r.ttl(store.keys.pages(src.id)) > 30
        await store.read(src.id)  # (a use of the shorter-lived one never shortens the page's)
        assert r.ttl(page) > 30
        # a session that expires rather than being deleted lets go by time: its pages go
        # with the last session that names them
        r.delete(*store.keys.of_session(fork.id))
        r.expire(page, 1)
        await asyncio.sleep(1.5)
        assert not r.exists(page)

    asyncio.run(go())


def test_a_session_stored_before_pages_moves_into_them_at_its_next_use(redis_url):
    """Keys written as the store wrote them before pages (the bytes in the session's own
    fields, app/store/keys.py at d8c1b4f and before): read, kept versions, a commit and a
    fork all work, and afterwards every byte is in a page."""
    r = redis.Redis.from_url(redis_url)

    async def go():
        store = _store(redis_url)
        sid = secrets.token_hex(16)
        k = store.keys
        # versions 0 (snapshot s0), 1 (delta d1), 2 (snapshot s2: s0 and d1 to the history), 3 (d3)
        r.hset(
            k.session(sid),
            mapping={
                "version": 3, "n_tokens": 4, "model": "m", "fingerprint": "fp", "created_at": "1.0",
                "expires_at": "9e9", "ttl": 60, "state": b"old-s2", "delta_bytes": 6, "commit": "c0ffee",
                "keep": 4, "history_bytes": 12, "meta_lo": 0, "blob_lo": 0, "transcript_bytes": 0,
                "tokens": "h3",
            },
        )  # fmt: skip
        r.rpush(k.deltas(sid), b"old-d3")
        versions = {f"{f}:{v}": x for v in range(4) for f, x in (("n", v + 1), ("t", "1.0"), ("h", f"h{v}"))}
        r.hset(
            k.history(sid),
            mapping={**versions, "b:0": 0, "b:1": 0, "b:2": 2, "b:3": 2, "s:0": b"old-s0", "d:1": b"old-d1"},
        )
        for key in (k.session(sid), k.deltas(sid), k.history(sid)):
            r.expire(key, 60)
        meta, blobs = await store.read(sid, with_state=True)
        assert blobs == StateBlobs(b"old-s2", (b"old-d3",)) and meta.snapshot_bytes == 6
        assert r.hget(k.session(sid), "paged") == b"1"
        assert (await store.read_at(sid, 1, "", state=True)).state == StateBlobs(b"old-s0", (b"old-d1",))
        assert (await store.read_at(sid, 2, "", state=True)).state == StateBlobs(b"old-s2")
        fork = await store.fork(sid, 1, "", fork_id(sid), ttl=60, keep=1, transcript=[])
        assert (await store.read(fork.id, with_state=True))[1] == StateBlobs(b"old-s0", (b"old-d1",))
        w = await store.begin(sid)
        await w.commit(5, delta=b"new-d4")
        assert (await store.read(sid, with_state=True))[1] == StateBlobs(b"old-s2", (b"old-d3", b"new-d4"))
        # no state bytes left in the session's own fields; every page has a TTL
        fields = [*r.hvals(k.session(sid)), *r.lrange(k.deltas(sid), 0, -1), *r.hvals(k.history(sid))]
        assert not any(v.startswith(b"old-") or v.startswith(b"new-") for v in fields)
        assert all(0 < r.ttl(p) <= 60 for p in pages_in_redis(r, store, sid))

    asyncio.run(go())
