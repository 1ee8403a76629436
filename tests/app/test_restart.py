"""SIGKILL the server (embedded Redis: no RECUR_REDIS_URL) and start it again: every
session continues from its last committed version, and no redis-server is orphaned."""

from __future__ import annotations

import os
import time

import pytest

from tests.conftest import ServerProcess

from .sse_client import generating

PROBE = "probe: où?"


def _probe(c, sid: str) -> list[float]:
    r = c.post(f"/v1/sessions/{sid}/score", json={"prompt": PROBE})
    assert r.status_code == 200, r.text
    return [t["logprob"] for t in r.json()["tokens"]]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    try:
        return " Z " not in open(f"/proc/{pid}/stat").read().split(")", 1)[1][:4]
    except OSError:
        return False


def test_sigkill_and_restart(tiny_model_dir, tmp_path):
    srv = ServerProcess(tiny_model_dir, tmp_path, redis_url=None, cpu_threads=1, lock_lease_seconds=1)
    srv.start()
    try:
        with srv.client() as c:
            a = c.post("/v1/sessions").json()["id"]
            b = c.post("/v1/sessions", json={"prompt": "two commits"}).json()["id"]
            for text in (" one", " two"):
                c.post(f"/v1/sessions/{b}/score", json={"prompt": text, "commit": True})
            g = c.post("/v1/sessions", json={"prompt": "gen"}).json()["id"]
            c.post(
                f"/v1/sessions/{g}/generate",
                json={"stream": False, "max_tokens": 9, "temperature": 0.7, "seed": 5},
            )
            f = c.post(f"/v1/sessions/{g}/fork").json()["id"]
            c.post(f"/v1/sessions/{f}/score", json={"prompt": "x", "commit": True})
            before = {sid: c.get(f"/v1/sessions/{sid}").json() for sid in (a, b, g, f)}
            probes = {sid: _probe(c, sid) for sid in (a, b, g, f)}
            assert [before[s]["version"] for s in (a, b, g, f)] == [0, 2, 1, 1]
            redis_pid = int((tmp_path / "data" / "redis.pid").read_text())
            # a generation in flight when the server dies must not be committed
            with generating(c, b):
                srv.kill()
        # the embedded redis-server goes down with its parent, having written its data
        for _ in range(200):
            if not _alive(redis_pid):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the embedded redis-server outlived the killed server")
        srv.start()
        with srv.client() as c:
            for sid, info in before.items():
                now = c.get(f"/v1/sessions/{sid}").json()
                assert (now["version"], now["n_tokens"]) == (info["version"], info["n_tokens"])
                assert _probe(c, sid) == pytest.approx(probes[sid], abs=1e-6)
            # the dead request's lock lapses after its lease; then the session moves on
            for _ in range(200):
                r = c.post(f"/v1/sessions/{b}/score", json={"prompt": "!", "commit": True})
                if r.status_code != 409:
                    break
                time.sleep(0.05)
            assert r.status_code == 200 and r.json()["session"]["version"] == 3
    finally:
        srv.stop()
    assert (tmp_path / "data" / "appendonly.aof").exists()
