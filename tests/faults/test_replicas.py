"""Several server processes on one Redis: racing writers, a stalled writer, and a
conversation handed back and forth between replicas.

Replicas A and B serve normally. Replica S stalls every commit (it runs
`tests/faults/stalled_server.py`, a test-only wrapper of `python -m app`: the writer stops
renewing its lock and sleeps before the commit script runs), with a lock lease far shorter than the stall, so another writer can
take the lapsed lock and commit first. The version fence must then refuse S's commit.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import redis

from tests.conftest import ServerProcess
from tests.stored_pages import loose_pages

from .harness import error_type, race, start_all, store_for, stored, stream_generate

STALL_SECONDS = 2.0
COMMON = dict(cpu_threads=1, max_tokens=64)


@dataclass
class Cluster:
    a: ServerProcess
    b: ServerProcess
    stalled: ServerProcess


@pytest.fixture(scope="module")
def cluster(model_dir, redis_url, tmp_path_factory) -> Iterator[Cluster]:
    prefix = f"replicas-{secrets.token_hex(4)}:"  # one key space: the replicas share sessions
    tmp = tmp_path_factory.mktemp("replicas")
    a = ServerProcess(model_dir, tmp / "a", redis_url, key_prefix=prefix, **COMMON)
    b = ServerProcess(model_dir, tmp / "b", redis_url, key_prefix=prefix, **COMMON)
    s = ServerProcess(
        model_dir, tmp / "s", redis_url, key_prefix=prefix, lock_lease_seconds=0.3,
        entry=("-m", "tests.faults.stalled_server", str(STALL_SECONDS)), **COMMON,
    )  # fmt: skip
    try:
        start_all(a, b, s)
        yield Cluster(a, b, s)
    finally:
        for srv in (a, b, s):
            srv.stop()


@pytest.fixture
def rdb(redis_url) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(redis_url)
    yield r
    r.close()


def create(c: httpx.Client, prompt: str | list[int]) -> dict:
    r = c.post("/v1/sessions", json={"prompt": prompt})
    assert r.status_code == 201, r.text
    return r.json()


# -- racing writers -----------------------------------------------------------------------
def test_racing_writers_lose_no_update(cluster, lm, rdb):
    """50 concurrent mutating requests on one session, spread over two replicas; each
    retries on 409 until it commits. Every commit lands exactly once, in order."""
    with cluster.a.client() as c:
        start = create(c, "race")
    sid, v0, n0 = start["id"], start["version"], start["n_tokens"]
    kinds = ("score", "generate", "stream")
    replicas = [("b", cluster.b.url), ("a", cluster.a.url)]  # the odd writers to a, the even to b
    writers = [(replicas[i % 2][1], kinds[i % 3], replicas[i % 2][0]) for i in range(50)]
    done, n = race(sid, writers, v0, n0)
    assert {replica for _, replica in done} == {"a", "b"}
    final = stored(rdb, store_for(cluster.a), sid, lm)
    assert (final.version, final.n_tokens) == (v0 + 50, n)


def test_forks_under_racing_writers_hold_committed_states(cluster, lm, rdb):
    """Forks taken on both replicas while 20 writers race on the session, then while it rolls
    back three versions: each fork holds a state the session committed (its token count is
    one of the versions'), and its stored pages verify; once the source is deleted, every
    fork still loads, and no page is left that neither a count nor a TTL reclaims."""
    with cluster.a.client() as c:
        start = create(c, "forked under load")
    sid, v0, n0 = start["id"], start["version"], start["n_tokens"]
    forks: list[dict] = []
    errors: list[str] = []
    stop = threading.Event()

    def forker() -> None:
        with httpx.Client(timeout=60) as c:
            for i in range(1000):
                if stop.is_set():
                    return
                r = c.post(f"{(cluster.a, cluster.b)[i % 2].url}/v1/sessions/{sid}/fork")
                (
                    forks.append(r.json())
                    if r.status_code == 201
                    else errors.append(f"{r.status_code} {r.text}")
                )

    thread = threading.Thread(target=forker)
    thread.start()
    kinds = ("score", "generate", "stream")
    writers = [((cluster.b, cluster.a)[i % 2].url, kinds[i % 3], "ba"[i % 2]) for i in range(20)]
    try:
        done, _ = race(sid, writers, v0, n0)
        # and a rollback, while the forks go on: to a version three commits back
        (back, n_back, _), _ = done[-4]
        with cluster.b.client() as c:
            rolled = c.post(f"/v1/sessions/{sid}/rollback", json={"version": back})
        assert rolled.status_code == 200, rolled.text
        assert (rolled.json()["version"], rolled.json()["n_tokens"]) == (v0 + len(writers) + 1, n_back)
        time.sleep(0.5)  # (forks of the rolled-back state too)
    finally:
        stop.set()
        thread.join()
    assert not errors, errors[:3]
    assert len(forks) >= 2, forks
    committed = {n0} | {n for (_, n, _), _ in done}
    keys = store_for(cluster.a)
    assert stored(rdb, keys, sid, lm).n_tokens == n_back
    for f in forks:
        assert f["n_tokens"] in committed and f["id"].startswith(sid + "."), f
        assert stored(rdb, keys, f["id"], lm).n_tokens == f["n_tokens"]
    with cluster.a.client() as c:
        assert c.delete(f"/v1/sessions/{sid}").is_success
    for f in forks:
        assert stored(rdb, keys, f["id"], lm).n_tokens == f["n_tokens"]
    assert not loose_pages(rdb, keys)


# -- stalled writer -------------------------------------------------------------------------
def _wait_locked(rdb: redis.Redis, key: str) -> None:
    end = time.monotonic() + 60
    while not rdb.exists(key):
        assert time.monotonic() < end, "the stalled request never took the lock"
        time.sleep(0.005)


@pytest.mark.parametrize("route", ["score", "stream"])
def test_stalled_writer_cannot_commit_over_a_newer_version(cluster, lm, rdb, route):
    keys = store_for(cluster.a)
    with cluster.a.client() as ca:
        sid = create(ca, "stall")["id"]
        control = create(ca, "stall")["id"]  # the same history, written by A alone
        result: list = []

        def stalled_request() -> None:
            with cluster.stalled.client() as cs:
                if route == "score":
                    result.append(
                        cs.post(f"/v1/sessions/{sid}/score", json={"prompt": "STALLED", "commit": True})
                    )
                else:
                    result.append(stream_generate(cs, sid, {"prompt": "STALLED", "max_tokens": 5}))

        t = threading.Thread(target=stalled_request)
        t.start()
        _wait_locked(rdb, keys.lock(sid))
        # the stalled writer stops renewing; once its lease lapses, A takes the lock and commits
        end = time.monotonic() + 30
        while True:
            r = ca.post(f"/v1/sessions/{sid}/score", json={"prompt": " A wins", "commit": True})
            if r.status_code != 409 or time.monotonic() > end:
                break
            time.sleep(0.02)
        assert r.status_code == 200, r.text
        t.join(timeout=60)
        assert not t.is_alive()
        # the stalled request fails cleanly, having committed nothing
        if route == "score":
            (res,) = result
            assert res.status_code == 409 and error_type(res) == "session_conflict", res.text
        else:
            (out,) = result
            assert (out.kind, out.error) == ("error", "session_conflict"), out
        assert (
            ca.post(f"/v1/sessions/{control}/score", json={"prompt": " A wins", "commit": True}).status_code
            == 200
        )
        # the session is exactly A's commit: same version, size, and next-token distribution
        got, want = stored(rdb, keys, sid, lm), stored(rdb, keys, control, lm)
        assert (
            (got.version, got.n_tokens)
            == (want.version, want.n_tokens)
            == (1, r.json()["session"]["n_tokens"])
        )
        probe = {"prompt": " next"}
        pa = ca.post(f"/v1/sessions/{sid}/score", json=probe).json()["tokens"]
        pc = ca.post(f"/v1/sessions/{control}/score", json=probe).json()["tokens"]
        assert [t["logprob"] for t in pa] == pytest.approx([t["logprob"] for t in pc], abs=1e-5)


# -- handover ------------------------------------------------------------------------------
def _converse(clients: list[httpx.Client]) -> tuple[list[float], list[int]]:
    """One conversation: each turn scores a user message and generates a reply, turns
    alternating over `clients`. Returns every log-prob (scored and generated) and the
    generated token ids."""
    text = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer"
    words = text.split(" ")
    sid = create(clients[0], words[0])["id"]
    lps: list[float] = []
    ids: list[int] = []
    for turn, word in enumerate(words[1:]):
        c = clients[turn % len(clients)]
        r = c.post(f"/v1/sessions/{sid}/score", json={"prompt": " " + word, "commit": True})
        assert r.status_code == 200, r.text
        lps += [t["logprob"] for t in r.json()["tokens"]]
        c = clients[(turn + 1) % len(clients)]
        body = {"max_tokens": 3, "temperature": 0.7, "seed": turn, "logprobs": True, "stream": False}
        r = c.post(f"/v1/sessions/{sid}/generate", json=body)
        assert r.status_code == 200, r.text
        lps += [t["logprob"] for t in r.json()["tokens"]]
        ids += [t["id"] for t in r.json()["tokens"]]
    return lps, ids


def test_handover_between_replicas_matches_one_process(cluster):
    with cluster.a.client() as ca, cluster.b.client() as cb:
        alternating = _converse([ca, cb])
        single = _converse([ca])
    assert alternating[1] == single[1]  # the same sampled tokens
    assert alternating[0] == pytest.approx(single[0], abs=1e-4)
    assert len(alternating[0]) > 60


# -- Redis loses a commit ------------------------------------------------------------------
def test_a_hot_cache_never_outlives_a_commit_redis_lost(cluster, rdb):
    """Redis loses the last commit (an everysec AOF after a host crash, or a failover to a
    replica that had not received it): the session is back at v0. Another replica then
    commits different content as v1. A replica that cached the lost v1 must not serve it."""
    keys = store_for(cluster.a)
    with cluster.a.client() as ca, cluster.b.client() as cb:
        sid = create(ca, "lost")["id"]
        lost = (keys.session(sid), keys.deltas(sid), keys.pages(sid))
        saved = {k: rdb.dump(k) for k in lost if rdb.exists(k)}
        assert (
            ca.post(f"/v1/sessions/{sid}/score", json={"prompt": " first", "commit": True}).status_code == 200
        )
        # Redis loses that commit: the keys are as they were at v0
        rdb.delete(*lost)
        for k, v in saved.items():
            rdb.restore(k, 0, v)
        rb = cb.post(f"/v1/sessions/{sid}/score", json={"prompt": " other", "commit": True})  # same length
        assert rb.status_code == 200 and rb.json()["session"]["version"] == 1
        probe = {"prompt": " probe"}
        via_a = ca.post(f"/v1/sessions/{sid}/score", json=probe).json()["tokens"]
        via_b = cb.post(f"/v1/sessions/{sid}/score", json=probe).json()["tokens"]
        assert [t["logprob"] for t in via_a] == pytest.approx([t["logprob"] for t in via_b], abs=1e-5)
