"""Planted state: a pickle that would run code when unpickled is written straight into a
session's state in Redis. Every route that uses the state must refuse it with a clean
error; the payload must never run (its marker file never appears); the server keeps
serving everyone else. Both model families.

The planted write also sets a new version and commit id, as any real write does, so a
server holding the session's previous state in its hot cache must go back to Redis for it.
"""

from __future__ import annotations

import io
import pickle
import secrets
from pathlib import Path

import pytest
import redis
import torch

from tests.faults.harness import store_for, stream_events
from tests.stored_pages import plant

from .conftest import assert_error


class Payload:
    """Unpickling this creates `marker` (and would do anything else just as easily)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _pickle(marker: Path) -> bytes:
    return pickle.dumps(Payload(marker))


def _torch_save(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save({"n_tokens": Payload(marker)}, buf)  # a zip around a pickle: what torch.load would run
    return buf.getvalue()


def _as_a_new_commit(r: redis.Redis, session_key: str) -> int:
    """Make the planted state look like any writer's commit: a new version and commit id,
    so no replica takes a state it holds in its hot cache for it."""
    r.hset(session_key, "commit", secrets.token_hex(8))
    return int(r.hincrby(session_key, "version", 1))


@pytest.mark.parametrize("family", ["txl", "rlt"])
@pytest.mark.parametrize("variant", ["pickle-snapshot", "torch-save-snapshot", "pickle-delta"])
def test_a_planted_pickle_is_refused_never_run(hostile_servers, redis_url, tmp_path, family, variant):
    server = hostile_servers[family]
    keys = store_for(server)
    marker = tmp_path / "PWNED"
    r = redis.Redis.from_url(redis_url)
    with server.client() as c:
        sid = c.post("/v1/sessions", json={"prompt": "victim"}).json()["id"]
        healthy = c.post("/v1/sessions", json={"prompt": "bystander"}).json()["id"]
        assert c.post(f"/v1/sessions/{sid}/score", json={"prompt": "!", "commit": True}).status_code == 200
        skey = keys.session(sid)
        if variant == "pickle-delta":
            plant(r, keys, sid, delta=_pickle(marker))
        else:
            plant(
                r,
                keys,
                sid,
                snapshot=_pickle(marker) if variant == "pickle-snapshot" else _torch_save(marker),
            )
        version = _as_a_new_commit(r, skey)

        for path, body in [
            ("/score", {"prompt": "x"}),
            ("/score", {"prompt": "x", "commit": True}),
            ("/generate", {"max_tokens": 2, "stream": False}),
        ]:
            assert_error(c.post(f"/v1/sessions/{sid}{path}", json=body), 500, "state_corrupt")
        # a stream refuses either before it starts or with an `error` event
        status, evs = stream_events(c, f"/v1/sessions/{sid}/generate", {"max_tokens": 2})
        if status == 200:
            assert evs and evs[-1][0] == "error" and evs[-1][1]["error"]["type"] == "state_corrupt", evs
            assert all(name != "done" for name, _ in evs)
        else:
            assert status == 500 and evs[0][1]["error"]["type"] == "state_corrupt"
        # reading metadata and forking never parse the blob; the fork is refused just the same
        assert c.get(f"/v1/sessions/{sid}").json()["version"] == version
        fork = c.post(f"/v1/sessions/{sid}/fork")
        assert fork.status_code == 201
        assert_error(
            c.post(f"/v1/sessions/{fork.json()['id']}/score", json={"prompt": "x"}), 500, "state_corrupt"
        )

        assert not marker.exists(), "the planted pickle was unpickled"
        assert int(r.hget(skey, "version")) == version  # nothing was committed over it
        # everyone else is served as before, and the bad session can still be deleted
        ok = c.post(f"/v1/sessions/{healthy}/generate", json={"max_tokens": 3, "stream": False})
        assert ok.status_code == 200, ok.text
        assert c.delete(f"/v1/sessions/{sid}").status_code == 204
        assert c.get("/readyz").status_code == 200
    r.close()


@pytest.mark.parametrize("family", ["txl", "rlt"])
def test_a_lost_delta_list_is_refused_not_silently_rolled_back(hostile_servers, redis_url, family):
    """If a session's deltas vanish (say, evicted by a Redis wrongly set to an LRU policy),
    snapshot alone is an older state than the session claims: continuing from it would
    silently fork the conversation. It must be refused instead."""
    server = hostile_servers[family]
    keys = store_for(server)
    r = redis.Redis.from_url(redis_url)
    with server.client() as c:
        sid = c.post("/v1/sessions", json={"prompt": "remember"}).json()["id"]
        assert (
            c.post(f"/v1/sessions/{sid}/score", json={"prompt": " this", "commit": True}).status_code == 200
        )
        assert r.llen(keys.deltas(sid)) >= 1  # the commit was stored as a delta
        r.delete(keys.deltas(sid))
        version = _as_a_new_commit(r, keys.session(sid))
        for path, body in [
            ("/score", {"prompt": "x"}),
            ("/score", {"prompt": "x", "commit": True}),
            ("/generate", {"max_tokens": 2, "stream": False}),
        ]:
            resp = c.post(f"/v1/sessions/{sid}{path}", json=body)
            assert resp.status_code == 500, resp.text
            assert resp.json()["error"]["type"] == "state_corrupt"
            assert "inconsistent" in resp.json()["error"]["message"]
        assert int(r.hget(keys.session(sid), "version")) == version
    r.close()
