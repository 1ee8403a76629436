"""Health routes, and a Redis that goes away and comes back: 503s, never a hang or a 500."""

from __future__ import annotations

import time

import pytest

from tests.conftest import RedisProcess, ServerProcess

from .sse_client import generating


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory):
    r = RedisProcess(tmp_path_factory.mktemp("own-redis"), appendonly=True)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def srv(own_redis, tiny_model_dir, tmp_path_factory):
    s = ServerProcess(
        tiny_model_dir, tmp_path_factory.mktemp("health"), own_redis.url, cpu_threads=1, redis_timeout=1
    )
    s.start()
    yield s
    s.stop()


def test_healthz_and_readyz(srv):
    with srv.client() as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        r = c.get("/readyz")
        assert r.status_code == 200
        assert (
            r.json()["status"] == "ready"
            and r.json()["model"] == "tiny"
            and len(r.json()["fingerprint"]) == 16
        )


def test_redis_down_gives_503_then_recovers(srv, own_redis):
    with srv.client() as c:
        sid = c.post("/v1/sessions", json={"prompt": "kept"}).json()["id"]
        c.post(f"/v1/sessions/{sid}/score", json={"prompt": "!", "commit": True})
        own_redis.stop()
        try:
            r = c.get("/readyz")
            assert r.status_code == 503 and r.json()["error"]["type"] == "redis_unavailable"
            assert c.get("/healthz").status_code == 200  # the process itself is fine
            for method, path, body in [
                ("POST", "/v1/sessions", None),
                ("GET", f"/v1/sessions/{sid}", None),
                ("DELETE", f"/v1/sessions/{sid}", None),
                ("POST", f"/v1/sessions/{sid}/fork", None),
                ("POST", f"/v1/sessions/{sid}/score", {"prompt": "a"}),
                ("POST", f"/v1/sessions/{sid}/score", {"prompt": "a", "commit": True}),
                ("POST", f"/v1/sessions/{sid}/generate", {"max_tokens": 2}),
                ("POST", f"/v1/sessions/{sid}/generate", {"max_tokens": 2, "stream": False}),
            ]:
                r = c.request(method, path, json=body)
                assert r.status_code == 503, (method, path, r.text)
                assert r.json()["error"]["type"] == "redis_unavailable"
        finally:
            restarted = RedisProcess(own_redis.directory, port=own_redis.port, appendonly=True)
            own_redis.proc = restarted.proc
        for _ in range(100):
            if c.get("/readyz").status_code == 200:
                break
            time.sleep(0.1)
        d = c.get(f"/v1/sessions/{sid}").json()
        assert d["version"] == 1 and d["n_tokens"] == 1 + len("kept!")


def test_redis_dying_mid_stream_sends_an_error_event(srv, own_redis):
    with srv.client() as c:
        sid = c.post("/v1/sessions").json()["id"]
        with generating(c, sid) as it:
            own_redis.stop()
            rest = list(it)
        restarted = RedisProcess(own_redis.directory, port=own_redis.port, appendonly=True)
        own_redis.proc = restarted.proc
        assert rest[-1][0] == "error" and rest[-1][1]["error"]["type"] == "redis_unavailable"
        assert all(name == "token" for name, _ in rest[:-1])
        for _ in range(100):
            r = c.get(f"/v1/sessions/{sid}")
            if r.status_code == 200:
                break
            time.sleep(0.1)
        assert r.json()["version"] == 0 and r.json()["n_tokens"] == 1
