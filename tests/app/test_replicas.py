"""Two app instances on one Redis keep each other's hot caches honest, and a full queue
answers 429 with Retry-After, over real HTTP."""

from __future__ import annotations

import secrets
import threading
import time

import pytest

from tests.conftest import ServerProcess

SETTINGS = {"max_tokens": 1000, "max_prompt_tokens": 300, "cpu_threads": 1}


@pytest.fixture(scope="module")
def replicas(tiny_model_dir, redis_url, tmp_path_factory):
    prefix = f"replicas-{secrets.token_hex(4)}:"
    servers = [
        ServerProcess(tiny_model_dir, tmp_path_factory.mktemp(name), redis_url, key_prefix=prefix, **SETTINGS)
        for name in ("a", "b")
    ]
    servers.append(  # the reference: one process without a hot cache, restarted midway
        ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("ref"), redis_url, hot_cache_mb=0, **SETTINGS)
    )
    for s in servers:
        s.start()
    yield servers
    for s in servers:
        s.stop()


def test_alternating_replicas_continue_from_the_latest_commit(replicas):
    """Seven turns of one session alternate between replicas A and B; the same seven turns of
    another session on the reference, a process with no hot cache that is restarted midway,
    so that each of its turns starts from the state in Redis: the same texts."""
    srv_a, _, srv_ref = replicas
    a, b = srv_a.client(), replicas[1].client()
    body = {"prompt": " and", "max_tokens": 6, "temperature": 0, "stream": False}
    sid = a.post("/v1/sessions", json={"prompt": "ROMEO:"}).json()["id"]
    with srv_ref.client() as ref:
        rid = ref.post("/v1/sessions", json={"prompt": "ROMEO:"}).json()["id"]
    hits_before = srv_a.metric("recur_hot_cache_hits_total")
    texts, ref_texts = [], []
    for turn, client in enumerate((a, a, b, a, b, b, a)):
        r = client.post(f"/v1/sessions/{sid}/generate", json=body)
        assert r.status_code == 200, r.text
        texts.append(r.json()["text"])
        if turn == 3:
            srv_ref.stop()
            srv_ref.start()
        with srv_ref.client() as ref:
            ref_texts.append(ref.post(f"/v1/sessions/{rid}/generate", json=body).json()["text"])
    assert texts == ref_texts
    final = a.get(f"/v1/sessions/{sid}").json()
    with srv_ref.client() as ref:
        assert (
            final["version"] == 7 and final["n_tokens"] == ref.get(f"/v1/sessions/{rid}").json()["n_tokens"]
        )
    # A's second request used its hot copy (Redis confirmed the version)
    assert srv_a.metric("recur_hot_cache_hits_total") >= hits_before + 1
    for c in (a, b):
        c.close()


@pytest.fixture(scope="module")
def tight(tiny_model_dir, redis_url, tmp_path_factory):
    srv = ServerProcess(
        tiny_model_dir,
        tmp_path_factory.mktemp("tight"),
        redis_url,
        max_batch_size=1,
        max_queued_requests=1,
        **SETTINGS,
    )
    srv.start()
    yield srv
    srv.stop()


def test_full_queue_answers_429_with_retry_after(tight):
    with tight.client() as c:
        s1, s2, s3 = (c.post("/v1/sessions", json={"prompt": "x"}).json()["id"] for _ in range(3))
        # greedy, so deterministic: this tiny model's greedy text has no EOS in 20k tokens
        long = {"max_tokens": 20_000, "temperature": 0, "stream": True}
        with c.stream("POST", f"/v1/sessions/{s1}/generate", json=long) as running:
            lines = running.iter_lines()  # (kept: dropping the iterator would close the stream)
            next(lines)  # s1 occupies the only batch slot
            queued: dict = {}

            def wait_in_queue():
                with tight.client() as c2:
                    queued["r"] = c2.post(
                        f"/v1/sessions/{s2}/generate", json={"max_tokens": 2, "stream": False}
                    )

            t = threading.Thread(target=wait_in_queue)
            t.start()
            deadline = time.monotonic() + 30
            while tight.metric("recur_num_requests_waiting") != 1:
                assert time.monotonic() < deadline, f"the second request never queued: {queued}"
                time.sleep(0.02)
            r = c.post(f"/v1/sessions/{s3}/generate", json={"max_tokens": 2, "stream": False})
            assert r.status_code == 429
            assert r.json()["error"]["type"] == "queue_full"
            assert int(r.headers["Retry-After"]) >= 1
        t.join(timeout=60)  # leaving the stream frees the slot: the queued request runs
        assert queued["r"].status_code == 200
        assert c.get(f"/v1/sessions/{s3}").json()["version"] == 0  # the refused request changed nothing
