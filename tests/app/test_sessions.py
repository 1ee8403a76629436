"""Every session route and status code, over real HTTP against `python -m app`."""

from __future__ import annotations

import json
import time
from datetime import datetime

import httpx
import pytest
import redis

from app.store import Keys
from tests.stored_pages import plant

from .sse_client import events, generate

BOS = 256  # the byte tokenizer's BOS id
V = 258


def create(http: httpx.Client, **body: object) -> dict:
    r = http.post("/v1/sessions", json=body or None)
    assert r.status_code == 201, r.text
    return r.json()


def error(r: httpx.Response, status: int, etype: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == etype
    assert body["error"]["message"]
    return body


# -- create / read / delete ---------------------------------------------------------------
def test_create_without_body_consumes_bos(http):
    r = http.post("/v1/sessions")
    assert r.status_code == 201
    s = r.json()
    assert set(s) == {"id", "version", "n_tokens", "model", "created_at", "expires_at"}
    assert len(s["id"]) == 32 and int(s["id"], 16) >= 0
    assert s["version"] == 0 and s["n_tokens"] == 1  # BOS only
    assert s["model"] == "tiny"
    assert r.headers["etag"] == '"0"'
    assert r.headers["location"] == f"/v1/sessions/{s['id']}"
    ttl = datetime.fromisoformat(s["expires_at"]) - datetime.fromisoformat(s["created_at"])
    assert abs(ttl.total_seconds() - 86400) < 60


def test_create_with_prompt_text_or_ids(http):
    a = create(http, prompt="héllo")
    b = create(http, prompt=list("héllo".encode()))
    assert a["n_tokens"] == b["n_tokens"] == 1 + len("héllo".encode())
    assert a["id"] != b["id"]
    # same history -> same distribution
    sa = http.post(f"/v1/sessions/{a['id']}/score", json={"prompt": "x"}).json()
    sb = http.post(f"/v1/sessions/{b['id']}/score", json={"prompt": "x"}).json()
    assert sa["tokens"][0]["logprob"] == pytest.approx(sb["tokens"][0]["logprob"], abs=1e-5)


def test_get_session_has_etag_and_state_bytes(http):
    s = create(http, prompt="abc")
    r = http.get(f"/v1/sessions/{s['id']}")
    assert r.status_code == 200
    d = r.json()
    assert d["id"] == s["id"] and d["version"] == 0 and d["n_tokens"] == 4 and d["state_bytes"] > 0
    assert r.headers["etag"] == '"0"'
    http.post(f"/v1/sessions/{s['id']}/score", json={"prompt": "d", "commit": True})
    r = http.get(f"/v1/sessions/{s['id']}")
    assert r.headers["etag"] == '"1"' and r.json()["n_tokens"] == 5


def test_delete_then_gone(http):
    s = create(http)
    assert http.delete(f"/v1/sessions/{s['id']}").status_code == 204
    error(http.get(f"/v1/sessions/{s['id']}"), 404, "session_not_found")
    error(http.delete(f"/v1/sessions/{s['id']}"), 404, "session_not_found")
    error(http.post(f"/v1/sessions/{s['id']}/generate", json={}), 404, "session_not_found")


@pytest.mark.parametrize("sid", ["nope", "0" * 32, "g" * 32, "zz-not-hex", "A" * 32, "0" * 33])
def test_unknown_or_garbage_ids_are_404(http, sid):
    for method, path, body in [
        ("GET", "", None),
        ("DELETE", "", None),
        ("POST", "/fork", None),
        ("POST", "/score", {"prompt": "a"}),
        ("POST", "/generate", {"max_tokens": 1}),
    ]:
        error(http.request(method, f"/v1/sessions/{sid}{path}", json=body), 404, "session_not_found")


def test_unknown_route_and_method(http):
    error(http.get("/v2/nothing"), 404, "not_found")
    error(http.put("/v1/sessions"), 405, "method_not_allowed")


# -- fork -----------------------------------------------------------------------------------
def test_fork_is_identical_then_independent(http):
    s = create(http, prompt="Once upon a time")
    r = http.post(f"/v1/sessions/{s['id']}/fork")
    assert r.status_code == 201
    f = r.json()
    assert f["id"] != s["id"] and f["n_tokens"] == s["n_tokens"] and f["version"] == 0
    # identical: same greedy continuation and same scores
    ga = http.post(f"/v1/sessions/{s['id']}/score", json={"prompt": " there"}).json()
    gb = http.post(f"/v1/sessions/{f['id']}/score", json={"prompt": " there"}).json()
    for a, b in zip(ga["tokens"], gb["tokens"], strict=True):
        assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-5)
    # independent: advancing the fork leaves the original untouched, and vice versa
    out = http.post(
        f"/v1/sessions/{f['id']}/generate", json={"stream": False, "max_tokens": 7, "temperature": 0}
    )
    assert out.json()["session"]["version"] == 1
    orig = http.get(f"/v1/sessions/{s['id']}").json()
    assert orig["version"] == 0 and orig["n_tokens"] == s["n_tokens"]
    again = http.post(f"/v1/sessions/{s['id']}/score", json={"prompt": " there"}).json()
    # the same state scored again; to a tolerance, since a state read back from Redis
    # rebuilds its key/value caches in one pass, which need not round like the incremental ones
    assert [t["logprob"] for t in again["tokens"]] == pytest.approx(
        [t["logprob"] for t in ga["tokens"]], abs=1e-6
    )
    assert http.delete(f"/v1/sessions/{s['id']}").status_code == 204
    assert http.get(f"/v1/sessions/{f['id']}").json()["version"] == 1


# -- score ----------------------------------------------------------------------------------
def test_score_without_and_with_commit(http):
    s = create(http, prompt="ab")
    r = http.post(f"/v1/sessions/{s['id']}/score", json={"prompt": "cd"})
    assert r.status_code == 200
    d = r.json()
    assert [t["id"] for t in d["tokens"]] == [99, 100] and [t["text"] for t in d["tokens"]] == ["c", "d"]
    assert all(t["logprob"] < 0 for t in d["tokens"])
    assert d["total_logprob"] == pytest.approx(sum(t["logprob"] for t in d["tokens"]))
    assert d["session"] == {"id": s["id"], "version": 0, "n_tokens": 3}
    c = http.post(f"/v1/sessions/{s['id']}/score", json={"prompt": "cd", "commit": True}).json()
    assert c["session"] == {"id": s["id"], "version": 1, "n_tokens": 5}
    assert [t["logprob"] for t in c["tokens"]] == pytest.approx([t["logprob"] for t in d["tokens"]], abs=1e-5)
    # the committed tokens are now context: scoring continues after them
    e = http.post(f"/v1/sessions/{s['id']}/score", json={"prompt": [BOS, 0]}).json()
    assert e["session"]["n_tokens"] == 5 and len(e["tokens"]) == 2 and e["tokens"][0]["text"] == "<bos>"


def test_score_empty_prompt(http):
    s = create(http)
    d = http.post(f"/v1/sessions/{s['id']}/score", json={"prompt": []}).json()
    assert d["tokens"] == [] and d["total_logprob"] == 0


# -- generate -------------------------------------------------------------------------------
def test_generate_stream_events(http):
    s = create(http, prompt="The ")
    tokens, final, done = generate(http, s["id"], max_tokens=40, temperature=1.5, seed=3, logprobs=True)
    assert final == "done"
    assert len(tokens) == 40 and [t["index"] for t in tokens] == list(range(40))
    for t in tokens:
        assert set(t) == {"index", "id", "text", "logprob"} and 0 <= t["id"] < V and t["logprob"] <= 0
    assert set(done) == {"text", "finish_reason", "usage", "session"}
    assert done["finish_reason"] == "length"
    assert done["usage"] == {"prompt_tokens": 0, "completion_tokens": 40}
    assert done["session"] == {"id": s["id"], "version": 1, "n_tokens": s["n_tokens"] + 40}
    # token texts add up to done.text exactly, even where bytes form multi-byte characters
    assert "".join(t["text"] for t in tokens) == done["text"]
    assert done["text"] == bytes(t["id"] for t in tokens if t["id"] < 256).decode("utf-8", errors="replace")
    assert any(t["id"] >= 0x80 for t in tokens)  # the random model does emit non-ASCII bytes


def test_stream_is_plain_ascii_lines(http):
    """Event data is ASCII-escaped JSON, so no generated character (U+2028, U+0085, ...)
    can look like a line break to an SSE client."""
    s = create(http)
    body = {"max_tokens": 200, "temperature": 2.0, "seed": 9}
    with http.stream("POST", f"/v1/sessions/{s['id']}/generate", json=body) as r:
        raw = r.read()
    assert max(raw) < 128
    lines = [ln for ln in raw.decode().split("\n") if ln.startswith("data:")]
    texts = [json.loads(ln[5:]) for ln in lines]
    assert len(texts) >= 2 and "".join(t.get("text", "") for t in texts[:-1]) == texts[-1]["text"]
    assert any(ord(c) > 127 for c in texts[-1]["text"])


def test_generate_without_logprobs_and_with_prompt(http):
    s = create(http)
    tokens, final, done = generate(http, s["id"], prompt="abc", max_tokens=3, seed=1)
    assert final == "done" and all(set(t) == {"index", "id", "text"} for t in tokens)
    assert done["usage"] == {"prompt_tokens": 3, "completion_tokens": 3}
    assert done["session"]["n_tokens"] == 1 + 3 + 3


def test_generate_json(http):
    s = create(http, prompt="x")
    r = http.post(
        f"/v1/sessions/{s['id']}/generate",
        json={"stream": False, "max_tokens": 5, "logprobs": True, "seed": 1},
    )
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    d = r.json()
    assert set(d) == {"text", "finish_reason", "usage", "session", "tokens"}
    assert len(d["tokens"]) == 5 and all("logprob" in t for t in d["tokens"])
    assert "".join(t["text"] for t in d["tokens"]) == d["text"]
    assert d["session"]["version"] == 1
    d2 = http.post(f"/v1/sessions/{s['id']}/generate", json={"stream": False, "max_tokens": 2}).json()
    assert all("logprob" not in t for t in d2["tokens"]) and d2["session"]["version"] == 2


def test_behaviour_logprob_matches_the_sampled_distribution(http):
    s = create(http, prompt="Hello")
    ref = http.post(f"/v1/sessions/{s['id']}/fork").json()
    # temperature 1 with no truncation samples from the model itself: behaviour = model log-prob
    tokens, _, _ = generate(http, s["id"], max_tokens=12, temperature=1.0, seed=11, logprobs=True)
    scored = http.post(f"/v1/sessions/{ref['id']}/score", json={"prompt": [t["id"] for t in tokens]}).json()
    for t, sc in zip(tokens, scored["tokens"], strict=True):
        assert t["logprob"] == pytest.approx(sc["logprob"], abs=1e-4)
    # top-k renormalises over the kept tokens: the behaviour log-prob is higher than the model's
    ref2 = http.post(f"/v1/sessions/{ref['id']}/fork").json()
    tokens, _, _ = generate(http, ref["id"], max_tokens=12, temperature=1.0, top_k=5, seed=11, logprobs=True)
    scored = http.post(f"/v1/sessions/{ref2['id']}/score", json={"prompt": [t["id"] for t in tokens]}).json()
    assert all(t["logprob"] > sc["logprob"] for t, sc in zip(tokens, scored["tokens"], strict=True))


def test_seed_reproduces_and_greedy_is_deterministic(http):
    s = create(http, prompt="seed")
    f1 = http.post(f"/v1/sessions/{s['id']}/fork").json()["id"]
    f2 = http.post(f"/v1/sessions/{s['id']}/fork").json()["id"]
    body = {"stream": False, "max_tokens": 20, "temperature": 0.8, "top_p": 0.9, "seed": 1234}
    a = http.post(f"/v1/sessions/{f1}/generate", json=body).json()
    b = http.post(f"/v1/sessions/{f2}/generate", json=body).json()
    assert [t["id"] for t in a["tokens"]] == [t["id"] for t in b["tokens"]]


def test_stop_string(http):
    s = create(http, prompt="ab")
    f = http.post(f"/v1/sessions/{s['id']}/fork").json()["id"]
    free = http.post(
        f"/v1/sessions/{s['id']}/generate", json={"stream": False, "max_tokens": 30, "temperature": 0}
    ).json()
    stop = free["text"][4:6]
    d = http.post(
        f"/v1/sessions/{f}/generate",
        json={"stream": False, "max_tokens": 30, "temperature": 0, "stop": [stop]},
    ).json()
    assert d["finish_reason"] == "stop"
    assert d["text"] == free["text"][: free["text"].index(stop) + len(stop)]
    assert d["session"]["n_tokens"] == s["n_tokens"] + d["usage"]["completion_tokens"]


# -- 409 / 412 --------------------------------------------------------------------------------
def test_busy_session_gives_409_at_once(http, server):
    s = create(http)
    with server.client() as other:
        with http.stream(
            "POST", f"/v1/sessions/{s['id']}/generate", json={"max_tokens": 1000, "temperature": 0}
        ) as r:
            it = events(r)  # (kept referenced: dropping it would close the stream)
            assert next(it)[0] == "token"  # the first request now holds the session
            busy = [other.post(f"/v1/sessions/{s['id']}{path}", json=body) for path, body in [
                ("/generate", {"max_tokens": 1}), ("/score", {"prompt": "a", "commit": True})
            ]] + [other.delete(f"/v1/sessions/{s['id']}")]  # fmt: skip
            for answer in busy:
                error(answer, 409, "session_busy")
                # when to retry: the lock's remaining lease (10 s), rounded up; by then a
                # holder that died has lost the lock
                assert 1 <= int(answer.headers["retry-after"]) <= 10
            # reads are not blocked by a writer
            assert other.get(f"/v1/sessions/{s['id']}").json()["version"] == 0
            assert other.post(f"/v1/sessions/{s['id']}/score", json={"prompt": "a"}).status_code == 200
            assert other.post(f"/v1/sessions/{s['id']}/fork").status_code == 201
        # the client hung up mid-stream: nothing committed, and the session is free again
        assert wait_writable(http, s["id"]) == 1
    assert http.get(f"/v1/sessions/{s['id']}").json()["n_tokens"] == 2


def wait_writable(http: httpx.Client, sid: str, tries: int = 200) -> int:
    """Commit one token once the session's lock is free; returns the version committed."""
    for _ in range(tries):
        r = http.post(f"/v1/sessions/{sid}/score", json={"prompt": "z", "commit": True})
        if r.status_code != 409:
            assert r.status_code == 200, r.text
            return r.json()["session"]["version"]
        time.sleep(0.05)
    raise AssertionError("the session stayed busy")


def test_if_match(http):
    s = create(http)
    sid = s["id"]
    stale = {"If-Match": '"5"'}
    error(
        http.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 1}, headers=stale),
        412,
        "version_mismatch",
    )
    error(
        http.post(f"/v1/sessions/{sid}/score", json={"prompt": "a"}, headers=stale), 412, "version_mismatch"
    )
    error(
        http.post(f"/v1/sessions/{sid}/score", json={"prompt": "a", "commit": True}, headers=stale),
        412,
        "version_mismatch",
    )
    error(http.post(f"/v1/sessions/{sid}/fork", headers=stale), 412, "version_mismatch")
    error(http.delete(f"/v1/sessions/{sid}", headers=stale), 412, "version_mismatch")
    error(http.post(f"/v1/sessions/{sid}/fork", headers={"If-Match": "banana"}), 422, "invalid_request")
    # the ETag, weak ETag, bare number and * all match the current version
    etag = http.get(f"/v1/sessions/{sid}").headers["etag"]
    r = http.post(
        f"/v1/sessions/{sid}/score", json={"prompt": "a", "commit": True}, headers={"If-Match": etag}
    )
    assert r.status_code == 200 and r.json()["session"]["version"] == 1
    for v in ['W/"1"', "1", "*"]:
        assert http.post(f"/v1/sessions/{sid}/fork", headers={"If-Match": v}).status_code == 201
    r = http.post(
        f"/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": 1}, headers={"If-Match": '"1"'}
    )
    assert r.json()["session"]["version"] == 2
    error(http.delete(f"/v1/sessions/{sid}", headers={"If-Match": '"1"'}), 412, "version_mismatch")
    assert http.delete(f"/v1/sessions/{sid}", headers={"If-Match": '"2"'}).status_code == 204


# -- 413 / 422 --------------------------------------------------------------------------------
def test_prompt_over_the_limit_is_413(http):
    s = create(http)
    long = "y" * 301  # the test server runs with --max-prompt-tokens 300
    error(http.post("/v1/sessions", json={"prompt": long}), 413, "prompt_too_long")
    error(http.post(f"/v1/sessions/{s['id']}/generate", json={"prompt": long}), 413, "prompt_too_long")
    error(http.post(f"/v1/sessions/{s['id']}/score", json={"prompt": [1] * 301}), 413, "prompt_too_long")
    assert http.post(f"/v1/sessions/{s['id']}/score", json={"prompt": "y" * 300}).status_code == 200
    assert http.get(f"/v1/sessions/{s['id']}").json()["version"] == 0


@pytest.mark.parametrize(
    "path,body",
    [
        ("/generate", {"temperature": -0.5}),
        ("/generate", {"top_p": 0}),
        ("/generate", {"top_p": 1.5}),
        ("/generate", {"top_k": -1}),
        ("/generate", {"max_tokens": 0}),
        ("/generate", {"seed": -3}),
        ("/generate", {"stream": "yes"}),
        ("/generate", {"stop": [""]}),
        ("/generate", {"unknown_field": 1}),
        ("/generate", {"prompt": [V]}),
        ("/generate", {"prompt": [-1]}),
        ("/generate", {"prompt": [1.5]}),
        ("/score", {}),
        ("/score", {"prompt": "a", "commit": 1}),
        ("/score", {"prompt": [0, 999]}),
    ],
)
def test_invalid_bodies_are_422(http, path, body):
    s = create(http)
    error(http.post(f"/v1/sessions/{s['id']}{path}", json=body), 422, "invalid_request")
    assert http.get(f"/v1/sessions/{s['id']}").json()["version"] == 0


def test_non_finite_numbers_and_bad_json_are_422(http):
    s = create(http)
    for raw in [
        '{"temperature": NaN}',
        '{"temperature": Infinity}',
        '{"top_p": -Infinity}',
        "{not json",
        "[1, 2]",
    ]:
        r = http.post(
            f"/v1/sessions/{s['id']}/generate",
            content=raw.encode(),
            headers={"content-type": "application/json"},
        )
        error(r, 422, "invalid_request")
    form = http.post(
        f"/v1/sessions/{s['id']}/generate",
        content=b'{"max_tokens": 2}',
        headers={"content-type": "text/plain"},
    )
    assert "Content-Type: application/json" in error(form, 422, "invalid_request")["error"]["message"]
    error(http.post("/v1/sessions", json={"ttl_seconds": 0}), 422, "invalid_request")
    error(http.post("/v1/sessions", json={"ttl_seconds": 10**9}), 422, "invalid_request")
    error(http.post("/v1/sessions", json={"prompt": "a", "extra": True}), 422, "invalid_request")


# -- a failure after streaming began ----------------------------------------------------------
def test_error_event_and_nothing_committed_when_the_fence_fails(http, server, redis_url):
    """Another writer commits while this one streams (as after an expired lock): the
    stream ends with an `error` event and its tokens are not committed."""
    s = create(http)
    keys = Keys(server.settings["key_prefix"])
    direct = redis.Redis.from_url(redis_url)
    with http.stream(
        "POST", f"/v1/sessions/{s['id']}/generate", json={"max_tokens": 300, "temperature": 0}
    ) as r:
        it = events(r)
        assert next(it)[0] == "token"
        direct.hset(keys.session(s["id"]), "version", 41)  # a commit we did not make
        rest = list(it)
    name, data = rest[-1]
    assert name == "error" and data["error"]["type"] == "session_conflict"
    assert all(n == "token" for n, _ in rest[:-1])
    d = http.get(f"/v1/sessions/{s['id']}").json()
    assert d["version"] == 41 and d["n_tokens"] == 1  # untouched by the failed request
    # the lock was released: the session is writable again
    assert (
        http.post(f"/v1/sessions/{s['id']}/score", json={"prompt": "a", "commit": True}).json()["session"][
            "version"
        ]
        == 42
    )
    direct.close()


def test_openapi_describes_every_route_with_the_error_schema(http):
    spec = http.get("/openapi.json").json()
    paths = spec["paths"]
    expected = {
        ("/v1/sessions", "post"): {"201", "413", "422", "503"},
        ("/v1/sessions/{session_id}", "get"): {"200", "404", "503"},
        ("/v1/sessions/{session_id}", "delete"): {"204", "404", "409", "412"},
        ("/v1/sessions/{session_id}/fork", "post"): {"201", "404", "412"},
        ("/v1/sessions/{session_id}/generate", "post"): {"200", "404", "409", "412", "413", "422", "503"},
        ("/v1/sessions/{session_id}/score", "post"): {"200", "404", "409", "412", "413", "422", "503"},
        ("/readyz", "get"): {"200", "503"},
        ("/healthz", "get"): {"200"},
    }
    for (path, method), codes in expected.items():
        responses = paths[path][method]["responses"]
        assert codes <= set(responses), (path, method, set(responses))
        for code, resp in responses.items():
            if code[0] in "45":
                assert (
                    resp["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/ErrorBody"
                )
    assert (
        "text/event-stream"
        in paths["/v1/sessions/{session_id}/generate"]["post"]["responses"]["200"]["content"]
    )
    assert "If-Match" in {
        p["name"] for p in paths["/v1/sessions/{session_id}/generate"]["post"]["parameters"]
    }


def test_foreign_model_and_corrupt_state_are_refused_cleanly(http, server, redis_url):
    keys = Keys(server.settings["key_prefix"])
    direct = redis.Redis.from_url(redis_url)
    a, b = create(http, prompt="a"), create(http, prompt="b")
    direct.hset(keys.session(a["id"]), "fingerprint", "0123456789abcdef")
    for path, body in [("/score", {"prompt": "x"}), ("/generate", {"max_tokens": 2})]:
        error(http.post(f"/v1/sessions/{a['id']}{path}", json=body), 409, "model_mismatch")
    # a damaged state under a new commit id, as any other writer's commit would leave it
    # (the replica's hot copy belongs to the old commit id, so the bytes are read and checked)
    plant(direct, keys, b["id"], snapshot=b"\x00" * 40)
    direct.hset(keys.session(b["id"]), "commit", "feedfacefeedface")
    error(http.post(f"/v1/sessions/{b['id']}/score", json={"prompt": "x"}), 500, "state_corrupt")
    error(
        http.post(f"/v1/sessions/{b['id']}/generate", json={"max_tokens": 2, "stream": False}),
        500,
        "state_corrupt",
    )
    tokens, final, data = generate(http, b["id"], max_tokens=2)
    assert tokens == [] and final == "error" and data["error"]["type"] == "state_corrupt"
    for sid in (a["id"], b["id"]):
        assert http.get(f"/v1/sessions/{sid}").json()["version"] == 0
    direct.close()
