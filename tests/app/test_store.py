"""SessionStore against a real Redis: the version fence, the lock lease, sliding TTL, and
a dead Redis failing fast."""

from __future__ import annotations

import asyncio
import contextlib
import secrets

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from app.config import Settings
from app.store import (
    CommitConflict,
    SessionBusy,
    SessionNotFound,
    SessionStore,
    StateBlobs,
    Store,
    StoreUnavailable,
    VersionGone,
    VersionMismatch,
)
from tests.conftest import free_port


def _store(url: str, **settings) -> SessionStore:
    return Store.from_settings(
        Settings(redis_url=url, key_prefix=f"store-test-{secrets.token_hex(4)}:", **settings)
    ).sessions


@contextlib.asynccontextmanager
async def holding(store: SessionStore, session_id: str, expected_version: int | None = None):
    """The writer lock for the block; leaving it without a commit changes nothing."""
    w = await store.begin(session_id, expected_version)
    try:
        yield w
    finally:
        await w.release()


def run(coro):
    return asyncio.run(coro)


def test_expired_lock_never_loses_an_update(redis_url):
    async def go():
        store = _store(redis_url)
        meta = await store.create(StateBlobs(b"s0"), 1, "m", "fp", ttl=60)
        a = await store.begin(meta.id)
        with pytest.raises(SessionBusy):
            await store.begin(meta.id)
        # A stalls past its lease: the lock lapses (as PEXPIRE would) and B takes over
        await store.connection.redis.delete(store.keys.lock(meta.id))
        b = await store.begin(meta.id)
        assert (await b.commit(2, snapshot=b"from-b")).version == 1
        with pytest.raises(CommitConflict):
            await a.commit(9, snapshot=b"from-a")
        await a.release()
        got, blob = await store.read(meta.id, with_state=True)
        assert got.version == 1 and got.n_tokens == 2 and blob == StateBlobs(b"from-b")
        # B's commit released the lock; A's late release did not remove anyone else's
        c = await store.begin(meta.id)
        await a.release()
        with pytest.raises(SessionBusy):
            await store.begin(meta.id)
        await c.release()
        await store.connection.close()

    run(go())


def test_the_holder_renews_its_lease(redis_url):
    async def go():
        store = _store(redis_url, lock_lease_seconds=0.6)
        meta = await store.create(StateBlobs(b"s"), 1, "m", "fp", ttl=60)
        async with holding(store, meta.id) as w:
            await asyncio.sleep(2.0)  # several leases long
            with pytest.raises(SessionBusy):
                await store.begin(meta.id)
            await w.commit(2, snapshot=b"t")
        assert (await store.read(meta.id))[0].version == 1
        async with holding(store, meta.id):
            pass  # leaving without a commit changes nothing and frees the lock
        assert (await store.read(meta.id))[0].version == 1
        async with holding(store, meta.id, expected_version=1) as w:
            await w.commit(3, snapshot=b"u")
        with pytest.raises(VersionMismatch):
            await store.begin(meta.id, expected_version=1)
        await store.connection.close()

    run(go())


def test_ttl_is_set_and_slides(redis_url):
    async def go():
        store = _store(redis_url)
        meta = await store.create(StateBlobs(b"s"), 1, "m", "fp", ttl=1000, keep=2)
        key = store.keys.session(meta.id)
        await store.connection.redis.expire(key, 10)  # as if time had passed
        await store.read(meta.id)
        assert 990 <= await store.connection.redis.ttl(key) <= 1000
        await store.connection.redis.expire(key, 10)
        async with holding(store, meta.id) as w:
            await w.commit(2, snapshot=b"t")
        assert 990 <= await store.connection.redis.ttl(key) <= 1000
        assert await store.connection.redis.pttl(store.keys.lock(meta.id)) == -2  # no lock left behind
        async with holding(store, meta.id) as w:  # the history and the transcript slide with it
            await w.commit(3, delta=b"u", segment=b"seg")
        for k in (store.keys.history(meta.id), store.keys.transcript(meta.id), store.keys.deltas(meta.id)):
            await store.connection.redis.expire(k, 10)
        at = await store.read_at(meta.id, 1, "", state=True, transcript=True)
        assert at.state == StateBlobs(b"t") and at.transcript == [b"seg"]
        for k in (store.keys.history(meta.id), store.keys.transcript(meta.id), store.keys.deltas(meta.id)):
            assert 990 <= await store.connection.redis.ttl(k) <= 1000
        await store.delete(meta.id)
        with pytest.raises(SessionNotFound):
            await store.read(meta.id)
        for k in (store.keys.history(meta.id), store.keys.transcript(meta.id), store.keys.deltas(meta.id)):
            assert not await store.connection.redis.exists(k)
        await store.connection.close()

    run(go())


@settings(max_examples=25, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["begin", "commit", "release", "expire"]), st.integers(0, 2)), max_size=25
    )
)
def test_interleaved_writers_commit_consecutive_versions(redis_url, ops):
    """Any interleaving of three writers: a commit lands iff nobody committed since its
    writer began, the version counts exactly the commits that landed, and the stored
    state is the last one that landed."""

    async def go():
        store = _store(redis_url)
        meta = await store.create(StateBlobs(b"v0"), 1, "m", "fp", ttl=60)
        writers: dict[int, object] = {}
        version, state = 0, b"v0"
        for op, i in ops:
            w = writers.get(i)
            if op == "begin" and w is None:
                try:
                    writers[i] = await store.begin(meta.id)
                    assert writers[i].meta.version == version
                except SessionBusy:
                    assert any(x is not None for x in writers.values())
            elif op == "commit" and w is not None:
                new = f"w{i}@{w.meta.version}".encode()
                if w.meta.version == version:
                    assert (await w.commit(1, snapshot=new)).version == version + 1
                    version, state = version + 1, new
                else:
                    with pytest.raises(CommitConflict):
                        await w.commit(1, snapshot=new)
                    await w.release()
                del writers[i]
            elif op == "release" and w is not None:
                await w.release()
                del writers[i]
            elif op == "expire":
                await store.connection.redis.delete(store.keys.lock(meta.id))
            got, blob = await store.read(meta.id, with_state=True)
            assert got.version == version and blob == StateBlobs(state)
        for w in writers.values():
            await w.release()
        await store.connection.close()

    run(go())


def test_dead_redis_fails_fast_with_store_unavailable():
    async def go():
        store = _store(f"redis://127.0.0.1:{free_port()}/0", redis_timeout=0.5)
        with pytest.raises(StoreUnavailable):
            await store.connection.ping()
        with pytest.raises(StoreUnavailable):
            await store.create(StateBlobs(b"s"), 1, "m", "fp", ttl=5)
        with pytest.raises(StoreUnavailable):
            await store.read("0" * 32)
        with pytest.raises(StoreUnavailable):
            await store.begin("0" * 32)
        await store.connection.close()

    run(go())


def test_garbage_ids_never_reach_redis(redis_url):
    async def go():
        store = _store(redis_url)
        for sid in ["", "x", "0" * 31, "0" * 33, "Z" * 32, "0" * 31 + "\n", "*"]:
            with pytest.raises(SessionNotFound):
                await store.read(sid)
        await store.connection.close()

    run(go())
    assert redis.Redis.from_url(redis_url).ping()


@pytest.mark.parametrize("ending", ["commit", "release"])
def test_a_finished_writer_and_its_state_bytes_are_freed_at_once(redis_url, ending):
    """A writer holds the state bytes its request started from. Once it has committed or
    released, nothing may keep it alive in a reference cycle (its lease renewer once did):
    reference counting alone must free it, not the cyclic garbage collector whenever it
    happens to run; under load those bytes added up to tens of MiB per replica."""
    import gc
    import weakref

    async def go():
        store = _store(redis_url)
        meta = await store.create(StateBlobs(b"s0"), 1, "m", "fp", ttl=60)
        writer = await store.begin(meta.id)
        if ending == "commit":
            await writer.commit(2, snapshot=b"s1")
        await writer.release()
        ref = weakref.ref(writer)
        del writer
        for _ in range(5):  # let the cancelled renewer finish
            await asyncio.sleep(0)
        alive = ref() is not None
        await store.connection.close()
        return alive

    gc.disable()
    try:
        assert not run(go()), "a finished writer is kept alive by a reference cycle"
    finally:
        gc.enable()


def test_a_burst_waits_for_the_bounded_pool_instead_of_flooding_redis(tmp_path):
    """40 concurrent commands through a store allowed 3 connections: every one succeeds,
    and Redis never sees more than 3 clients from it."""
    from app.store import CLIENT_NAME
    from tests.conftest import RedisProcess

    own = RedisProcess(tmp_path)
    try:

        async def go():
            store = _store(own.url, redis_max_connections=3)
            meta = await store.create(StateBlobs(b"s" * 100_000), 1, "m", "fp", ttl=60)
            reads = await asyncio.gather(*(store.read(meta.id, with_state=True) for _ in range(40)))
            clients = await store.connection.redis.client_list()
            await store.connection.close()
            return reads, [c for c in clients if c.get("name") == CLIENT_NAME]

        reads, ours = run(go())
        assert all(blobs == StateBlobs(b"s" * 100_000) for _, blobs in reads)
        assert 1 <= len(ours) <= 3
    finally:
        own.stop()


def test_kept_versions_rebuild_from_the_history_and_nothing_else_stays(redis_url):
    """Every kept version reads back as exactly the blobs that made it, across deltas and
    snapshots that replaced them; a version past the history is gone; and the history holds
    only what a kept version needs."""

    async def go():
        store = _store(redis_url)
        meta = await store.create(StateBlobs(b"S0", (b"x", b"y")), 1, "m", "fp", ttl=100, keep=3)
        chains = {0: StateBlobs(b"S0", (b"x", b"y"))}  # version -> what rebuilds it
        plan = [
            "delta",
            "delta",
            "snapshot",
            "delta",
            "snapshot",
            "snapshot",
            "delta",
            "delta",
            "delta",
            "snapshot",
        ]
        for v, mode in enumerate(plan, start=1):
            blob = f"{mode[0]}{v}".encode()
            async with holding(store, meta.id) as w:
                await w.commit(v + 1, **{mode: blob}, segment=b"seg%d" % v)
            prev = chains[v - 1]
            chains[v] = (
                StateBlobs(blob) if mode == "snapshot" else StateBlobs(prev.snapshot, (*prev.deltas, blob))
            )
            kept = await store.versions(meta.id, "")
            assert [x.version for x in kept[1]] == list(range(max(0, v - 2), v + 1))
            for u in range(max(0, v - 2), v + 1):
                at = await store.read_at(meta.id, u, "", state=True)
                assert at.state == chains[u] and at.version.n_tokens == u + 1, (v, u)
            with pytest.raises(VersionGone):
                await store.read_at(meta.id, v - 3 if v >= 3 else v + 1, "")
            # the history holds exactly the blobs of the replaced chains that kept versions use
            fields = await store.connection.redis.hkeys(store.keys.history(meta.id))
            blobs = sorted(f.decode() for f in fields if f[:2] in (b"s:", b"d:"))
            needed = set()
            for u in range(max(0, v - 2), v + 1):
                base = u - len(chains[u].deltas)
                if base < v - len(chains[v].deltas):  # not the current chain: archived
                    needed |= {f"s:{base}"} | {f"d:{x}" for x in range(base + 1, u + 1)}
            assert blobs == sorted(needed), v
        at = await store.read_at(meta.id, None, "", transcript=True)
        assert at.transcript == [b"seg%d" % v for v in range(1, 11)]
        await store.connection.close()

    run(go())


def test_the_transcript_is_bounded_and_says_so(redis_url):
    async def go():
        store = _store(redis_url, transcript_max_kb=1)
        meta = await store.create(StateBlobs(b"s"), 1, "m", "fp", ttl=100, transcript=[b"a" * 300])
        for v in range(1, 6):
            async with holding(store, meta.id) as w:
                await w.commit(1, delta=b"d", segment=bytes([v]) * 300)
        at = await store.read_at(meta.id, None, "", transcript=True)
        assert at.trimmed and at.transcript == [bytes([v]) * 300 for v in (3, 4, 5)]
        got = await store.read(meta.id)
        assert got[0].history_bytes == 900
        await store.connection.close()

    run(go())


def test_a_large_state_goes_to_redis_in_pieces_and_arrives_whole(redis_url, monkeypatch):
    """A commit of a large state never hands the event loop all of it at once (a SmolLM2
    state is up to 47 MB; written whole, its copies held every other request for about
    0.12 s), and the pieces arrive whole and in order."""
    from asyncio import selector_events

    from app.store.connection import PIECE

    sizes: list[int] = []
    write = selector_events._SelectorSocketTransport.write

    def counted(self, data):
        sizes.append(len(data))
        return write(self, data)

    monkeypatch.setattr(selector_events._SelectorSocketTransport, "write", counted)
    big, bigger = secrets.token_bytes(5 * PIECE + 123), secrets.token_bytes(9 * PIECE)

    async def go():
        store = _store(redis_url)
        meta = await store.create(StateBlobs(big), 1, "m", "fp", ttl=60)
        async with holding(store, meta.id) as w:
            await w.commit(2, snapshot=bigger)
        got, blob = await store.read(meta.id, with_state=True)
        assert got.version == 1 and blob == StateBlobs(bigger)
        await store.connection.close()

    run(go())
    assert sizes and max(sizes) <= PIECE, max(sizes)
    assert sum(sizes) > len(big) + len(bigger)
