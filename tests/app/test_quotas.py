"""Quotas per tenant over real HTTP, real servers and a real Redis: sessions, stored bytes,
requests and generated tokens per key, shared by every replica; 429 quota_exceeded with
Retry-After changes nothing, and another key keeps being served; a Redis near its
maxmemory answers 507 storage_full before it refuses writes itself."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import RedisProcess, ServerProcess

SMALL, BIG, SLOW, TOKENS = "key-small-sessions", "key-big", "key-slow-requests", "key-few-tokens"
FLOOD = "key-that-floods"


@pytest.fixture(scope="module")
def servers(tiny_model_dir, redis_url, tmp_path_factory) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """Two replicas on one Redis and one key file."""
    keyfile = tmp_path_factory.mktemp("keys") / "api-keys"
    keyfile.write_text(
        f"{SMALL} sessions=3\n{BIG}\n{SLOW} requests_per_second=4\n{TOKENS} tokens_per_second=20\n"
        f"{FLOOD} sessions=5\n"
    )
    common = dict(cpu_threads=1, api_keys_file=keyfile, key_prefix="quota-test:")
    a = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("a"), redis_url, **common)
    b = ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("b"), redis_url, **common)
    a.start()
    b.start()
    yield a, b
    a.stop()
    b.stop()


def client(server: ServerProcess, key: str) -> httpx.Client:
    return server.client(headers={"Authorization": f"Bearer {key}"})


def refused(r: httpx.Response, limit_word: str) -> float:
    assert r.status_code == 429, r.text
    assert r.json()["error"]["type"] == "quota_exceeded"
    assert limit_word in r.json()["error"]["message"]
    return float(r.headers["retry-after"])


def usage(c: httpx.Client) -> dict:
    r = c.get("/v1/usage")
    assert r.status_code == 200, r.text
    return r.json()


def test_a_key_holds_at_most_its_sessions_on_every_replica(servers):
    a, b = servers
    with client(a, SMALL) as ca, client(b, SMALL) as cb, client(a, BIG) as big:
        made = [ca.post("/v1/sessions", json={"prompt": "x"}).json()["id"] for _ in range(2)]
        made.append(cb.post("/v1/sessions", json={"prompt": "x"}).json()["id"])
        # the fourth, on either replica, is refused: nothing is created
        assert refused(ca.post("/v1/sessions", json={"prompt": "x"}), "sessions") >= 1
        refused(cb.post("/v1/sessions", json={"prompt": "x"}), "sessions")
        refused(cb.post(f"/v1/sessions/{made[0]}/fork"), "sessions")
        assert usage(ca)["sessions"] == 3 and usage(cb)["limits"]["sessions"] == 3
        # another key is served meanwhile
        assert big.post("/v1/sessions", json={"prompt": "x"}).status_code == 201
        # what it holds still works: a generation commits
        r = ca.post(f"/v1/sessions/{made[0]}/generate", json={"stream": False, "max_tokens": 3, "seed": 1})
        assert r.status_code == 200, r.text
        # a deleted session frees its place
        assert cb.delete(f"/v1/sessions/{made[1]}").status_code == 204
        assert usage(ca)["sessions"] == 2
        assert ca.post("/v1/sessions", json={"prompt": "x"}).status_code == 201


def test_a_flood_from_one_key_gets_exactly_its_quota_while_another_key_is_served(servers):
    """40 concurrent creates over both replicas from a key allowed 5: exactly 5 land (the
    ledger is one atomic script in Redis), and another key's generations all succeed."""
    a, b = servers
    answers: list[int] = []
    served: list[int] = []

    def flood(server: ServerProcess) -> None:
        with client(server, FLOOD) as c:
            for _ in range(20):
                answers.append(c.post("/v1/sessions", json={"prompt": "x"}).status_code)

    def other() -> None:
        with client(b, BIG) as c:
            sid = c.post("/v1/sessions", json={"prompt": "y"}).json()["id"]
            for k in range(8):
                r = c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": 4, "seed": k})
                served.append(r.status_code)

    threads = [threading.Thread(target=flood, args=(s,)) for s in (a, b, a, b)]
    threads.append(threading.Thread(target=other))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(set(answers)) == [201, 429] and answers.count(201) == 5, answers
    assert served == [200] * 8
    with client(a, FLOOD) as c:
        assert usage(c)["sessions"] == 5


def test_an_expired_session_leaves_its_keys_quota(servers):
    a, _ = servers
    with client(a, BIG) as c:
        before = usage(c)["sessions"]
        assert c.post("/v1/sessions", json={"prompt": "x", "ttl_seconds": 1}).status_code == 201
        assert usage(c)["sessions"] == before + 1
        time.sleep(2.2)  # Redis expires the session; the ledger drops it when next read
        assert usage(c)["sessions"] == before


def test_the_request_rate_is_shared_by_the_replicas(servers):
    """4 requests/s, a burst of 4: over both replicas together, never more."""
    a, b = servers
    with client(a, SLOW) as ca, client(b, SLOW) as cb, client(b, BIG) as big:
        time.sleep(1.5)  # a full bucket
        t0 = time.monotonic()
        answers = [(ca if i % 2 else cb).get("/v1/usage") for i in range(24)]
        elapsed = time.monotonic() - t0
        ok = sum(r.status_code == 200 for r in answers)
        assert ok <= 4 + 4 * elapsed + 1, (ok, elapsed)
        waits = [refused(r, "requests per second") for r in answers if r.status_code != 200]
        assert waits and all(1 <= w <= 1 for w in waits)  # under a second, rounded up
        assert all(big.get("/v1/usage").status_code == 200 for _ in range(10))  # another key is not slowed
        time.sleep(waits[-1])
        assert ca.get("/v1/usage").status_code == 200


def test_generated_tokens_are_charged_and_the_debt_waited_out(servers):
    a, b = servers
    with client(a, TOKENS) as ca, client(b, TOKENS) as cb:
        sid = ca.post("/v1/sessions", json={"prompt": "x"}).json()["id"]
        time.sleep(1.1)  # a full bucket: 20 tokens
        r = ca.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": 60, "seed": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 60
        # 40 tokens in debt at 20/s: the next generation, on any replica, waits about 2 s
        wait = refused(cb.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 1}), "tokens per second")
        assert 1 <= wait <= 3
        version = ca.get(f"/v1/sessions/{sid}").json()["version"]
        assert version == 1  # the refused request changed nothing
        assert cb.post(f"/v1/sessions/{sid}/score", json={"prompt": "a"}).status_code == 200  # reads pass
        time.sleep(wait)
        r = cb.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": 2, "seed": 3})
        assert r.status_code == 200, r.text


def test_usage_and_metrics_name_the_key_by_a_hash(servers):
    a, _ = servers
    with client(a, BIG) as c:
        u = usage(c)
        key_id = hashlib.sha256(BIG.encode()).hexdigest()[:24]
        assert u["tenant"] == key_id and u["sessions"] >= 1 and u["state_bytes"] > 0
        assert a.metric("recur_tenant_sessions", key=BIG, tenant=key_id) >= 1
        assert a.metric("recur_quota_refusals_total", key=BIG, limit="sessions") >= 1
        assert BIG not in c.get("/metrics").text


@pytest.fixture(scope="module")
def tight(tiny_model_dir, tmp_path_factory) -> Iterator[tuple[ServerProcess, RedisProcess]]:
    """No keys (one quota for every client), 20 KiB of state at most, and its own Redis."""
    red = RedisProcess(tmp_path_factory.mktemp("small-redis"))
    srv = ServerProcess(
        tiny_model_dir,
        tmp_path_factory.mktemp("tight"),
        red.url,
        cpu_threads=1,
        quota_sessions=1000,
        quota_state_mb=0.02,  # ~20 KiB: 18 fresh sessions of the tiny model (1,160 bytes each)
        storage_guard=0.8,
    )
    srv.start()
    yield srv, red
    srv.stop()
    red.stop()


def test_without_keys_one_quota_holds_for_all(tight):
    srv, _ = tight
    with srv.client() as c:
        made: list[str] = []
        for _ in range(500):
            answer = c.post("/v1/sessions", json={"prompt": "x"})
            if answer.status_code != 201:
                break
            made.append(answer.json()["id"])
        refused(answer, "bytes")
        u = usage(c)
        assert u["tenant"] == "open" and u["sessions"] == len(made) >= 2
        assert u["state_bytes"] <= u["limits"]["state_bytes"] == int(0.02 * 2**20)
        # a commit that would grow a session past the quota is refused, and changes nothing
        before = c.get(f"/v1/sessions/{made[0]}").json()
        r = c.post(f"/v1/sessions/{made[0]}/generate", json={"stream": False, "max_tokens": 200, "seed": 0})
        refused(r, "bytes")
        assert c.get(f"/v1/sessions/{made[0]}").json()["version"] == before["version"]
        # reads go on
        assert c.post(f"/v1/sessions/{made[0]}/score", json={"prompt": "ab"}).status_code == 200


def test_a_nearly_full_redis_answers_507_before_it_refuses_writes(tight, tmp_path_factory):
    srv, red = tight
    import redis

    client = redis.Redis.from_url(red.url)
    try:
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 64 * 2**10)
        time.sleep(1.1)  # the server reads Redis's memory at most once a second
        with srv.client() as c:
            r = c.post("/v1/sessions", json={"prompt": "x"})
            assert r.status_code == 507, r.text
            assert r.json()["error"]["type"] == "storage_full" and r.headers["retry-after"]
            ready = c.get("/readyz")
            assert ready.status_code == 200 and ready.json()["storage_full"] is True
        client.config_set("maxmemory", 0)
        time.sleep(1.1)
        with srv.client() as c:
            assert c.get("/readyz").json()["storage_full"] is False
    finally:
        client.close()
