"""The session invariants end to end, over real HTTP: transactional disconnects, one
writer per session, boundary invariance, sliding expiry."""

from __future__ import annotations

import asyncio
import socket
import time
from datetime import datetime

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .boundaries import assert_scored_alike, create
from .sse_client import events

SERVER_SETTINGS = {"max_tokens": 300}

TEXT = "It is a truth universally acknowledged, that a single man — ça va? — wants a wife."


def wait_version(http: httpx.Client, sid: str, tries: int = 200) -> tuple[int, int]:
    """(version, n_tokens) once the session is writable again (its lock was released)."""
    for _ in range(tries):
        r = http.post(f"/v1/sessions/{sid}/score", json={"prompt": [], "commit": False})
        assert r.status_code == 200
        probe = http.post(f"/v1/sessions/{sid}/fork", headers={"If-Match": "*"})
        assert probe.status_code == 201
        http.delete(f"/v1/sessions/{probe.json()['id']}")
        busy = http.delete(f"/v1/sessions/{sid}", headers={"If-Match": '"999999"'})
        if busy.status_code == 412:  # not 409: no writer holds it
            d = http.get(f"/v1/sessions/{sid}").json()
            return d["version"], d["n_tokens"]
        assert busy.status_code == 409
        time.sleep(0.05)
    raise AssertionError("the session stayed busy")


def test_max_tokens_is_capped_by_config(http):
    s = create(http)
    body = {"stream": False, "max_tokens": 10_000, "temperature": 0}
    d = http.post(f"/v1/sessions/{s['id']}/generate", json=body).json()
    assert d["usage"]["completion_tokens"] == 300 and d["finish_reason"] == "length"


def test_disconnect_mid_stream_leaves_version_unchanged(http):
    s = create(http, prompt="abc")
    http.post(f"/v1/sessions/{s['id']}/score", json={"prompt": "d", "commit": True})
    with http.stream(
        "POST", f"/v1/sessions/{s['id']}/generate", json={"max_tokens": 300, "temperature": 0}
    ) as r:
        it = events(r)
        for _ in range(3):
            assert next(it)[0] == "token"
    # the connection is closed: the server drops the generation and commits nothing
    assert wait_version(http, s["id"]) == (1, 5)


def test_disconnect_during_non_streaming_generate_commits_nothing(http, server):
    s = create(http)
    body = b'{"stream": false, "max_tokens": 300, "temperature": 0}'
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(
            f"POST /v1/sessions/{s['id']}/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
    assert wait_version(http, s["id"]) == (0, 1)


def test_twenty_concurrent_generates_one_wins(http, server):
    """20 generates at once on one session: one succeeds, 19 get 409 immediately.

    The winner generates 300 tokens; the 19 others are answered from one Redis script
    each, which is orders of magnitude quicker, so they all meet the held lock."""
    s = create(http)

    async def go() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=20, max_keepalive_connections=20)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            await asyncio.gather(*(client.get("/healthz") for _ in range(20)))  # open the connections first
            body = {"stream": False, "max_tokens": 300, "temperature": 0}
            return await asyncio.gather(
                *(client.post(f"/v1/sessions/{s['id']}/generate", json=body) for _ in range(20))
            )

    results = asyncio.run(go())
    codes = sorted(r.status_code for r in results)
    assert codes == [200] + [409] * 19
    for r in results:
        if r.status_code == 409:
            assert r.json()["error"]["type"] == "session_busy"
    won = next(r for r in results if r.status_code == 200).json()
    assert won["session"]["version"] == 1
    # versions stay consecutive under contention from here on
    seen = [1]
    for _ in range(3):
        rs = asyncio.run(_burst(server.url, s["id"], 5))
        seen += sorted(r.json()["session"]["version"] for r in rs if r.status_code == 200)
        assert all(r.status_code in (200, 409) for r in rs)
    assert seen == list(range(1, len(seen) + 1))
    assert http.get(f"/v1/sessions/{s['id']}").json()["version"] == seen[-1]


async def _burst(url: str, sid: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        return await asyncio.gather(
            *(
                client.post(f"/v1/sessions/{sid}/score", json={"prompt": "ab", "commit": True})
                for _ in range(n)
            )
        )


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(min_value=1, max_value=len(TEXT.encode()) - 1), max_size=5, unique=True))
def test_boundary_invariance_end_to_end(http, cuts):
    """Scoring TEXT in one request, or committed over many, gives the same per-token
    log-probs, and greedy generation then continues identically."""
    whole, split, pieces = assert_scored_alike(http, list(TEXT.encode()), cuts, max_tokens=24)
    assert pieces["version"] == len(cuts) + 1 and pieces["n_tokens"] == 1 + len(TEXT.encode())
    for sid in (whole, split):
        http.delete(f"/v1/sessions/{sid}")


def test_generation_split_over_requests_matches_one_request(http):
    """Greedy: 30 tokens in one generate == 3 generates of 10, and the text adds up."""
    a = create(http, prompt="Boundary")
    b = http.post(f"/v1/sessions/{a['id']}/fork").json()
    body = {"stream": False, "temperature": 0, "logprobs": True}
    one = http.post(f"/v1/sessions/{a['id']}/generate", json={**body, "max_tokens": 30}).json()
    parts = [
        http.post(f"/v1/sessions/{b['id']}/generate", json={**body, "max_tokens": 10}).json()
        for _ in range(3)
    ]
    ids = [t["id"] for p in parts for t in p["tokens"]]
    lps = [t["logprob"] for p in parts for t in p["tokens"]]
    assert ids == [t["id"] for t in one["tokens"]]
    assert lps == pytest.approx([t["logprob"] for t in one["tokens"]], abs=1e-4)
    assert (
        parts[-1]["session"]["version"] == 3
        and parts[-1]["session"]["n_tokens"] == one["session"]["n_tokens"]
    )


def test_session_expires_after_its_ttl(http):
    s = create(http, ttl_seconds=1)
    assert http.get(f"/v1/sessions/{s['id']}").status_code == 200
    for _ in range(100):  # Redis expires the key about a second after the last use
        time.sleep(0.1)
        r = http.get(f"/v1/sessions/{s['id']}") if _ % 10 == 9 else None
        if r is not None and r.status_code == 404:
            break
    else:
        raise AssertionError("the session outlived its ttl")
    assert r.json()["error"]["type"] == "session_not_found"


def test_ttl_slides_with_each_use(http):
    s = create(http, ttl_seconds=600)
    first = datetime.fromisoformat(s["expires_at"])
    time.sleep(1.1)
    d = http.get(f"/v1/sessions/{s['id']}").json()
    later = datetime.fromisoformat(d["expires_at"])
    assert (later - first).total_seconds() >= 1.0
    assert abs((later - datetime.fromisoformat(d["created_at"])).total_seconds() - 601.1) < 30


def test_prompt_in_generate_equals_scoring_it_first(http):
    a = create(http, prompt="Once")
    b = http.post(f"/v1/sessions/{a['id']}/fork").json()
    body = {"stream": False, "temperature": 0, "max_tokens": 16, "logprobs": True}
    one = http.post(f"/v1/sessions/{a['id']}/generate", json={**body, "prompt": " upon a time"}).json()
    http.post(f"/v1/sessions/{b['id']}/score", json={"prompt": " upon a time", "commit": True})
    two = http.post(f"/v1/sessions/{b['id']}/generate", json=body).json()
    assert [t["id"] for t in one["tokens"]] == [t["id"] for t in two["tokens"]]
    assert [t["logprob"] for t in one["tokens"]] == pytest.approx(
        [t["logprob"] for t in two["tokens"]], abs=1e-4
    )
    assert one["session"]["n_tokens"] == two["session"]["n_tokens"]


def test_concurrent_sessions_match_one_at_a_time(http, server):
    """Sessions generating at the same time (decoded in shared batches) get exactly what
    each would get alone."""
    prompts = ["a", "longer prompt, past the memory length of the tiny model", "€", "ok"]
    originals = [create(http, prompt=p)["id"] for p in prompts]
    copies = [http.post(f"/v1/sessions/{sid}/fork").json()["id"] for sid in originals]
    bodies = [
        {"stream": False, "max_tokens": 40, "logprobs": True, "temperature": t, "seed": i, "top_k": k}
        for i, (t, k) in enumerate([(0, 0), (1.0, 0), (0.7, 20), (1.2, 5)])
    ]

    async def together() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            rs = await asyncio.gather(
                *(
                    client.post(f"/v1/sessions/{sid}/generate", json=b)
                    for sid, b in zip(originals, bodies, strict=True)
                )
            )
        return [r.json() for r in rs]

    batched = asyncio.run(together())
    alone = [
        http.post(f"/v1/sessions/{sid}/generate", json=b).json()
        for sid, b in zip(copies, bodies, strict=True)
    ]
    for x, y in zip(batched, alone, strict=True):
        assert [t["id"] for t in x["tokens"]] == [t["id"] for t in y["tokens"]]
        assert [t["logprob"] for t in x["tokens"]] == pytest.approx(
            [t["logprob"] for t in y["tokens"]], abs=1e-4
        )
        assert x["text"] == y["text"]
