"""The store and the server on a real Redis Cluster (three primaries) and a real Sentinel
(a primary, a replica and one Sentinel), through the `redis+cluster://` and
`redis+sentinel://` forms of RECUR_REDIS_URL.

Cluster: every session route over HTTP, the store's keys each in one slot, a burst held to
the connection bound, 50 racing writers, and a SIGKILLed primary that fails its own
sessions only. Sentinel: a manual failover and a SIGKILL of the primary, after which the
same server process serves from the new primary.

The processes come from tests/app/cluster_harness.py. The SIGKILL tests leave their node
dead, so each comes last among the tests of its setup.
"""

from __future__ import annotations

import asyncio
import secrets
import shutil
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import redis
import redis.cluster

import model
from app.config import Settings
from app.store import CLIENT_NAME, SessionStore, StateBlobs, Store, StoreUnavailable, fork_id, parse_redis_url
from model.chat_template import play_script
from model.reader import write_chat_template
from tests.app.sse_client import events, generate
from tests.conftest import ServerProcess
from tests.faults.harness import error_type, race, store_for, stored, stream_generate

from .cluster_harness import SERVICE, LocalCluster, LocalSentinel, wait_for

SETTINGS = dict(cpu_threads=1, max_tokens=64, redis_timeout=2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


def _served(redis_url: str, tiny_model_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    chat = tmp_path_factory.mktemp("chat") / "tiny"  # (the tiny model, with the play script: Responses)
    shutil.copytree(tiny_model_dir, chat)
    write_chat_template(chat, play_script())
    with ServerProcess(chat, tmp_path_factory.mktemp("server"), redis_url, **SETTINGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def cluster_server(cluster, tiny_model_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    yield from _served(cluster.url, tiny_model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSentinel]:
    with LocalSentinel(tmp_path_factory.mktemp("sentinel")) as s:
        yield s


@pytest.fixture(scope="module")
def sentinel_server(sentinel, tiny_model_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    yield from _served(sentinel.url, tiny_model_dir, tmp_path_factory)


def _store(url: str, **settings: object) -> SessionStore:
    return Store.from_settings(
        Settings(redis_url=url, key_prefix=f"cluster-test-{secrets.token_hex(4)}:", **settings)
    ).sessions


def create(c: httpx.Client, prompt: str = "hi") -> dict:
    r = c.post("/v1/sessions", json={"prompt": prompt})
    assert r.status_code == 201, r.text
    return r.json()


def unavailable(r: httpx.Response) -> bool:
    return r.status_code == 503 and error_type(r) == "redis_unavailable"


# -- the URL forms ----------------------------------------------------------------------------
def test_url_forms():
    c = parse_redis_url("redis+cluster://a:7000,b,[::1]:7002")
    assert (c.kind, c.nodes, c.db) == ("cluster", (("a", 7000), ("b", 6379), ("::1", 7002)), 0)
    s = parse_redis_url("redis+sentinel://u:p%40ss@s1:26380,s2/my-primary/3")
    assert (s.kind, s.nodes, s.service, s.db) == ("sentinel", (("s1", 26380), ("s2", 26379)), "my-primary", 3)
    assert (s.username, s.password) == ("u", "p@ss")
    assert parse_redis_url("redis://localhost:6379/0").kind == "server"
    assert parse_redis_url("rediss://h/1").kind == "server"
    for bad in (
        "redis+cluster://",  # no host
        "redis+cluster://a:7000/2",  # a Cluster has db 0 only
        "redis+cluster://a:port",
        "redis+sentinel://s1:26379",  # no service
        "redis+sentinel://s1:26379/name/x",
    ):
        with pytest.raises(ValueError, match="form is"):
            parse_redis_url(bad)


# -- Cluster ----------------------------------------------------------------------------------
def test_store_on_cluster_keeps_each_session_in_one_slot(cluster):
    """Sessions land on every primary; each one's keys (session, deltas, lock, history,
    transcript) are on the primary that serves its slot, and every operation works there."""

    async def go() -> None:
        store = _store(cluster.url)
        seen: set[int] = set()
        while len(seen) < len(cluster.nodes):
            meta = await store.create(
                StateBlobs(b"snap", (b"d0",)), 1, "m", "fp", ttl=60, keep=3, transcript=[b"t"]
            )
            node = cluster.primary_for(store.keys.session(meta.id))
            seen.add(node.port)
            # session, deltas, lock, history, transcript, the family's pages
            keys = store.keys.of_session(meta.id)
            r = node.client()
            w = await store.begin(meta.id)
            pages = [f"{keys[5]}:{p.decode()}" for p in r.hkeys(keys[5])]
            assert len(pages) == 2  # (the snapshot's and the delta's)
            assert len({r.cluster("KEYSLOT", k) for k in [*keys, *pages]}) == 1
            assert r.exists(*keys, *pages) == 8  # (all on this primary, the lock held)
            after = await w.commit(2, delta=b"d1")
            assert after.version == 1 and r.exists(keys[2]) == 0
            _, blobs = await store.read(meta.id, with_state=True)
            assert blobs == StateBlobs(b"snap", (b"d0", b"d1"))
            w = await store.begin(meta.id, expected_version=1)
            await w.commit(3, snapshot=b"new")
            past = await store.read_at(meta.id, 1, "", state=True, transcript=True)  # from the history
            assert past.state == StateBlobs(b"snap", (b"d0", b"d1")) and past.transcript == [b"t"]
            # a fork lives in its source's slot, and names its pages: it outlives its source
            fork = await store.fork(meta.id, 2, "", fork_id(meta.id), ttl=60, keep=3, transcript=[b"f"])
            assert len({r.cluster("KEYSLOT", k) for k in [*keys, *store.keys.of_session(fork.id)]}) == 1
            await store.delete(meta.id)
            assert (await store.read(fork.id, with_state=True))[1] == StateBlobs(b"new")
            await store.delete(fork.id)
            # all gone but the lock, a tombstone holding the delete's token for at most a minute
            # (a retried delete recognises its own first run: app/store/lua/delete.lua)
            assert r.exists(*keys[:2], *keys[3:]) == 0 and 0 < r.pttl(keys[2]) <= 60_000
            assert not r.hkeys(keys[5]) and not list(r.scan_iter(f"{keys[5]}:*"))
        await store.connection.ping()
        await store.connection.close()

    asyncio.run(go())


def test_a_burst_on_cluster_waits_for_the_connection_bound(cluster):
    """40 concurrent commands through a store allowed 3 connections all succeed (the
    cluster client alone would fail past its limit), and no node sees more than 3, plus
    the one the client learnt the cluster's layout through."""

    async def go() -> None:
        store = _store(cluster.url, redis_max_connections=3)
        meta = await store.create(StateBlobs(b"s" * 100_000), 1, "m", "fp", ttl=60)
        reads = await asyncio.gather(*(store.read(meta.id, with_state=True) for _ in range(40)))
        await store.connection.ping()
        assert all(blobs == StateBlobs(b"s" * 100_000) for _, blobs in reads)
        ours = Counter(
            node.port
            for node in cluster.nodes
            for client in node.client().client_list()
            if client.get("name") == CLIENT_NAME
        )
        await store.connection.close()
        assert ours and max(ours.values()) <= 3 + 1, ours

    asyncio.run(go())


def test_every_session_route_on_cluster(cluster_server):
    assert httpx.get(cluster_server.url + "/readyz").status_code == 200
    with cluster_server.client() as c:
        s = create(c, "héllo")
        sid = s["id"]
        r = c.get(f"/v1/sessions/{sid}")
        assert r.status_code == 200 and r.json()["version"] == 0 and r.json()["state_bytes"] > 0
        tokens, last, done = generate(c, sid, max_tokens=5, seed=1)
        assert last == "done" and len(tokens) == 5 and done["session"]["version"] == 1
        r = c.post(f"/v1/sessions/{sid}/generate", json={"prompt": "x", "max_tokens": 4, "stream": False})
        assert r.status_code == 200 and r.json()["session"]["version"] == 2
        with c.stream("GET", f"/v1/sessions/{sid}/generate", params={"max_tokens": 3}) as r:
            assert r.status_code == 200
            assert [name for name, _ in events(r)][-1] == "done"
        r = c.post(f"/v1/sessions/{sid}/score", json={"prompt": "ab", "commit": True})
        assert r.status_code == 200 and r.json()["session"]["version"] == 4
        r = c.post(f"/v1/sessions/{sid}/fork", headers={"If-Match": '"4"'})
        assert r.status_code == 201
        fork = r.json()
        assert fork["id"] != sid and fork["n_tokens"] == c.get(f"/v1/sessions/{sid}").json()["n_tokens"]
        for x in (sid, fork["id"]):
            assert c.delete(f"/v1/sessions/{x}").status_code == 204
            r = c.get(f"/v1/sessions/{x}")
            assert r.status_code == 404 and error_type(r) == "session_not_found"


def test_a_response_chain_on_cluster_keeps_to_its_slot(cluster, cluster_server):
    """A chain of responses on Cluster: each continuation's id is in its chain (one slot for
    its record, its events and the chain's turns), its turns render alone, a turn under other
    instructions walks the chain in one script, and deleting every response leaves no key."""
    with cluster_server.client() as c:

        def respond(text: str, previous: str | None, instructions: str) -> dict:
            body = {"input": text, "previous_response_id": previous, "instructions": instructions,
                    "temperature": 0, "max_output_tokens": 8}  # fmt: skip
            r = c.post("/v1/responses", json=body)
            assert r.status_code == 200, r.text
            return r.json()

        made = [respond("Hark.", None, "A wall.")]
        for text in ("Who?", "Speak."):
            made.append(respond(text, made[-1]["id"], "A wall."))
            assert made[-1]["usage"]["input_tokens_details"]["cached_tokens"] > 0
        made.append(respond("Louder.", made[-1]["id"], "A moat."))  # (rendered whole: the walk)
        tag = made[0]["id"]
        assert all(m["id"].startswith(tag) for m in made)
        slot = redis.cluster.key_slot(f"{{{tag}}}".encode())
        assert all(redis.cluster.key_slot(f"x:{{{tag}}}{m['id'][len(tag) :]}".encode()) == slot for m in made)
        for m in made:
            assert c.delete(f"/v1/responses/{m['id']}").status_code == 200
    keys = [k for node in cluster.nodes for k in node.client().scan_iter(match=f"*{tag}*")]
    assert all(b"response:" in k for k in keys), keys  # (only the deletes' tombstones: no turn left)


def test_racing_writers_on_cluster_lose_no_update(cluster, cluster_server, tiny_model_dir):
    """50 mutating requests race on one session; each retries on 409 until it commits.
    Every commit lands exactly once, in order (as tests/faults/test_replicas.py, on a Cluster)."""
    n_writers = 50
    with cluster_server.client() as c:
        start = create(c, "race")
    sid, v0, n0 = start["id"], start["version"], start["n_tokens"]
    kinds = ("stream", "score")
    _, n = race(sid, [(cluster_server.url, kinds[i % 2], "cluster") for i in range(n_writers)], v0, n0)
    rdb = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    try:
        final = stored(rdb, store_for(cluster_server), sid, model.load(tiny_model_dir, device="cpu"))
    finally:
        rdb.close()
    assert (final.version, final.n_tokens) == (v0 + n_writers, n)


def test_sigkill_of_a_primary_fails_only_its_own_sessions(cluster, cluster_server):
    """One session on each primary; SIGKILL one primary. Its session gets 503
    redis_unavailable; the others keep serving every route, before and after the cluster
    flags the node failed, with every script loaded again after the kill (the survivors'
    script caches are flushed, and loading one must not need the dead node)."""
    keys = store_for(cluster_server)
    by_node: dict[int, str] = {}
    with cluster_server.client() as c:
        while len(by_node) < len(cluster.nodes):
            sid = create(c)["id"]
            by_node.setdefault(cluster.primary_for(keys.session(sid)).port, sid)
        victim = cluster.nodes[1]
        for node in cluster.nodes:
            node.client().script_flush()
        victim.kill()

        def check() -> None:
            for port, sid in by_node.items():
                get = c.get(f"/v1/sessions/{sid}")
                gen = c.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 2, "stream": False})
                score = c.post(f"/v1/sessions/{sid}/score", json={"prompt": "a", "commit": True})
                if port == victim.port:
                    assert unavailable(get) and unavailable(gen) and unavailable(score), (get.text, gen.text)
                else:
                    assert (get.status_code, gen.status_code, score.status_code) == (200, 200, 200), gen.text
                    assert stream_generate(c, sid, {"max_tokens": 2}).kind == "done"

        check()
        cluster.wait_failed(victim)
        check()
        assert httpx.get(cluster_server.url + "/readyz").status_code == 200
        # a new session lands on a random slot: on the dead primary's it gets 503 (and a
        # retry gets another id, so another slot); elsewhere it is created and serves
        statuses = []
        for _ in range(30):
            r = c.post("/v1/sessions", json={"prompt": "new"})
            statuses.append(r.status_code)
            if r.status_code == 201:
                sid = r.json()["id"]
                assert cluster.primary_for(keys.session(sid)) is not victim
                assert c.get(f"/v1/sessions/{sid}").status_code == 200
                break
            # (a create the dead primary's slot never answered is unknown, not failed: a write
            # that timed out may have landed; the next attempt takes another id)
            assert unavailable(r) or (r.status_code == 503 and error_type(r) == "outcome_unknown"), r.text
        assert statuses[-1] == 201, statuses
    assert cluster_server.proc is not None and cluster_server.proc.poll() is None


# -- Sentinel ---------------------------------------------------------------------------------
def _serves_from(new_primary, c: httpx.Client, sid: str, key: str, since: float) -> int:
    """Generate on `sid` until a commit lands on `new_primary` (one taken by the old
    primary before the server knew is lost with it). Meanwhile 503 redis_unavailable, or
    409 session_conflict (a request began on the old primary and the fence refused its
    commit on the new one), never another error. Returns the version committed there."""
    seen: Counter[str] = Counter()
    while True:
        r = c.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 2, "stream": False})
        if r.status_code == 200:
            seen["200"] += 1
            version = r.json()["session"]["version"]
            if new_primary.client().hget(key, "version") == str(version).encode():
                return int(version)
        else:
            seen[error_type(r)] += 1
            assert unavailable(r) or (r.status_code, error_type(r)) == (409, "session_conflict"), r.text
        assert time.monotonic() - since < 30, seen
        time.sleep(0.1)


def _survives_failover(sentinel: LocalSentinel, server: ServerProcess, fail: str) -> None:
    """A session commits on the primary, and the primary fails over: `manual` (SENTINEL
    FAILOVER; the old primary lives on and is demoted only later) or `sigkill`. The same
    server process then commits on the new primary within seconds of the switch, at the
    next version. A store in this process whose connection still points at the old primary
    sees at most one StoreUnavailable, and its next command works."""
    assert sentinel.sentinel is not None
    sentinel.wait_ready()
    loop = asyncio.new_event_loop()
    store = _store(sentinel.url)
    try:
        mine = loop.run_until_complete(store.create(StateBlobs(b"before"), 1, "m", "fp", ttl=600))
        with server.client() as c:
            sid = create(c, "failover")["id"]
            r = c.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 2, "stream": False})
            assert r.status_code == 200 and r.json()["session"]["version"] == 1
            old = sentinel.primary()
            assert old.client().wait(1, 5000) == 1  # the replica holds both sessions
            if fail == "manual":
                sentinel.sentinel.client().execute_command("SENTINEL FAILOVER", SERVICE)
            else:
                old.kill()
            wait_for("Sentinel names a new primary", lambda: sentinel.primary_port() != old.port)
            switched = time.monotonic()
            new = sentinel.primary()

            version = _serves_from(new, c, sid, store_for(server).session(sid), switched)
            assert version == 2
            # a Sentinel round, not the old primary's demotion (which takes Sentinel ~10 s)
            assert time.monotonic() - switched < 5
            r = c.post(f"/v1/sessions/{sid}/score", json={"prompt": "z", "commit": True})
            assert r.status_code == 200 and r.json()["session"]["version"] == 3
            assert httpx.get(server.url + "/readyz").status_code == 200
        assert server.proc is not None and server.proc.poll() is None  # the same process

        if fail == "manual":
            # the store's one connection still reaches the old primary (its last command
            # ran before the failover), and it has not asked the Sentinels since: then the
            # old primary is demoted, as Sentinel does some seconds later, and a write
            # there fails READONLY (as a script error, which redis-py does not act on)
            store.connection._next_ask = time.monotonic() + 3600
            old.client().replicaof("127.0.0.1", new.port)
        outcomes: list[str] = []
        for _ in range(2):
            try:
                _, blobs = loop.run_until_complete(store.read(mine.id, with_state=True))
            except StoreUnavailable:
                outcomes.append("unavailable")
            else:
                assert blobs == StateBlobs(b"before")
                outcomes.append("ok")
                break
        if fail == "manual":
            assert outcomes == ["unavailable", "ok"]
        else:
            assert outcomes in (["ok"], ["unavailable", "ok"]), outcomes
    finally:
        loop.run_until_complete(store.connection.close())
        loop.close()


def test_sentinel_manual_failover_is_followed_without_restart(sentinel, sentinel_server):
    _survives_failover(sentinel, sentinel_server, "manual")


def test_sentinel_failover_after_sigkill_is_followed_without_restart(sentinel, sentinel_server):
    _survives_failover(sentinel, sentinel_server, "sigkill")
