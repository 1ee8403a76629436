"""A session's history over real HTTP against the real Redis: kept versions rebuild exactly
(the same bytes as each version's own snapshot, whatever deltas and snapshots came after),
fork and rollback reach them, fenced like every write, and the transcript holds exactly
the tokens the state consumed, with the action mask and behaviour log-probs."""

from __future__ import annotations

import httpx
import pytest
import redis

A, B = "key-history-a", "key-history-b"
SERVER_SETTINGS = {"api_keys": f"{A},{B}", "history_versions": 4, "max_history_versions": 16}


def create(c: httpx.Client, prompt: str = "ROMEO:", **body) -> dict:
    r = c.post("/v1/sessions", json={"prompt": prompt, **body})
    assert r.status_code == 201, r.text
    return r.json()


def generate(c: httpx.Client, sid: str, n: int = 12, prompt: str = "", **params) -> dict:
    body = {"stream": False, "max_tokens": n, "temperature": 0, "logprobs": True, "prompt": prompt, **params}
    r = c.post(f"/v1/sessions/{sid}/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def ids(result: dict) -> list[int]:
    return [t["id"] for t in result["tokens"]]


def export(c: httpx.Client, sid: str, version: int | None = None) -> bytes:
    r = c.get(f"/v1/sessions/{sid}/state", params={} if version is None else {"version": version})
    assert r.status_code == 200, r.text
    return r.content


def test_every_kept_version_rebuilds_to_its_own_snapshot(a, server, redis_url):
    s = create(a, keep_versions=6)
    snapshots = {0: export(a, s["id"])}
    for v in range(1, 13):  # enough deltas that snapshots replace them within the kept window
        if v % 4 == 0:
            r = a.post(f"/v1/sessions/{s['id']}/score", json={"prompt": " and so", "commit": True})
            assert r.status_code == 200, r.text
        else:
            generate(a, s["id"], 10 + v)
        snapshots[v] = export(a, s["id"])
    # some kept versions are built on snapshots that newer ones replaced (the hard case)
    with redis.Redis.from_url(redis_url) as r:
        fields = r.hkeys(f"{server.settings['key_prefix']}history:{{{s['id']}}}")
    assert any(f.startswith(b"s:") for f in fields) and any(f.startswith(b"d:") for f in fields), fields
    kept = a.get(f"/v1/sessions/{s['id']}/versions").json()
    assert kept["version"] == 12 and [x["version"] for x in kept["versions"]] == list(range(7, 13))
    for x in kept["versions"]:
        r = a.get(f"/v1/sessions/{s['id']}/state", params={"version": x["version"]})
        assert r.status_code == 200 and r.headers["etag"] == f'"{x["version"]}"'
        assert r.content == snapshots[x["version"]], x
    r = a.get(f"/v1/sessions/{s['id']}/state", params={"version": 6})
    assert r.status_code == 409 and r.json()["error"]["type"] == "version_gone"
    assert "oldest it keeps is 7" in r.json()["error"]["message"]


def test_fork_at_a_version_and_rollback_reach_the_past_state(a):
    s = create(a)
    v1 = generate(a, s["id"])
    v2 = generate(a, s["id"])
    generate(a, s["id"])
    r = a.post(f"/v1/sessions/{s['id']}/fork", json={"version": 1})
    assert r.status_code == 201, r.text
    fork = r.json()
    assert fork["version"] == 0 and fork["n_tokens"] == v1["session"]["n_tokens"]
    assert ids(generate(a, fork["id"])) == ids(v2)  # greedy from version 1's state, as before
    # roll back: fenced on the current version, and a new version, not a rewrite of history
    r = a.post(f"/v1/sessions/{s['id']}/rollback", json={"version": 1}, headers={"If-Match": '"2"'})
    assert r.status_code == 412 and r.json()["error"]["type"] == "version_mismatch"
    r = a.post(f"/v1/sessions/{s['id']}/rollback", json={"version": 1}, headers={"If-Match": '"3"'})
    assert r.status_code == 200, r.text
    back = r.json()
    assert back["version"] == 4 and back["n_tokens"] == v1["session"]["n_tokens"]
    assert r.headers["etag"] == '"4"'
    again = generate(a, s["id"])  # regenerate: the same greedy reply as version 2's
    assert ids(again) == ids(v2)
    assert [t["logprob"] for t in again["tokens"]] == pytest.approx(
        [t["logprob"] for t in v2["tokens"]], abs=1e-4
    )
    # the versions rolled back over are still kept: roll forward again
    r = a.post(f"/v1/sessions/{s['id']}/rollback", json={"version": 3})
    assert r.status_code == 200 and r.json()["version"] == 6


def test_versions_past_the_history_and_bad_requests_get_clear_errors(a, b):
    s = create(a, keep_versions=2)
    for _ in range(3):
        generate(a, s["id"], 4)
    for path, body in (("rollback", {"version": 1}), ("fork", {"version": 0})):
        r = a.post(f"/v1/sessions/{s['id']}/{path}", json=body)
        assert r.status_code == 409 and r.json()["error"]["type"] == "version_gone", r.text
    r = a.post(f"/v1/sessions/{s['id']}/rollback", json={"version": 9})  # not yet
    assert r.status_code == 409 and r.json()["error"]["type"] == "version_gone"
    for body in ({}, {"version": -1}, {"version": "1"}):
        r = a.post(f"/v1/sessions/{s['id']}/rollback", json=body)
        assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request", body
    r = a.post("/v1/sessions", json={"keep_versions": 17})
    assert r.status_code == 422 and "keep_versions" in r.json()["error"]["message"]
    # another key sees none of it
    for method, path, body in (
        ("GET", "versions", None),
        ("GET", "transcript", None),
        ("POST", "rollback", {"version": 3}),
        ("POST", "fork", {"version": 3}),
    ):
        r = b.request(method, f"/v1/sessions/{s['id']}/{path}", json=body)
        assert r.status_code == 404 and r.json()["error"]["type"] == "session_not_found", path
    assert a.get(f"/v1/sessions/{s['id']}").json()["version"] == 3  # nothing changed


def test_the_transcript_is_what_the_state_consumed(a):
    s = create(a)
    sampled = generate(a, s["id"], 16, prompt=" Speak", temperature=0.8, top_p=0.9, seed=7)
    r = a.post(f"/v1/sessions/{s['id']}/score", json={"prompt": [65, 66], "commit": True})
    assert r.status_code == 200, r.text
    greedy = generate(a, s["id"], 8)
    t = a.get(f"/v1/sessions/{s['id']}/transcript").json()
    assert t["complete"] and t["version"] == 3
    segs = t["segments"]
    assert [g["kind"] for g in segs] == ["create", "generate", "score", "generate"]
    assert [g["version"] for g in segs] == [0, 1, 2, 3]
    position = 0
    for g in segs:  # contiguous, and adding up to the state's tokens
        assert g["start"] == position and len(g["ids"]) == len(g["sampled"]) == len(g["logprobs"]) == len(
            g["texts"]
        )
        assert "".join(g["texts"]) == g["text"]
        position += len(g["ids"])
    assert position == t["n_tokens"] == greedy["session"]["n_tokens"]
    gen = segs[1]
    n_prompt = len(gen["ids"]) - len(sampled["tokens"])
    assert gen["sampled"] == [False] * n_prompt + [True] * len(sampled["tokens"])
    assert gen["ids"][n_prompt:] == ids(sampled) and gen["text"].endswith(sampled["text"])
    assert gen["logprobs"][n_prompt:] == pytest.approx([x["logprob"] for x in sampled["tokens"]], abs=1e-6)
    assert gen["logprobs"][:n_prompt] == [None] * n_prompt
    assert gen["sampling"]["temperature"] == 0.8 and gen["sampling"]["top_p"] == 0.9 and gen["seed"] == 7
    assert segs[2]["ids"] == [65, 66] and not any(segs[2]["sampled"]) and segs[2]["sampling"] is None
    # the transcript rebuilds the state: a new session fed its text continues identically
    bos = create(a, "")["n_tokens"]  # 1 when the model has a BOS token, which create adds
    clone = create(a, [i for g in segs for i in g["ids"]][bos:])
    assert clone["n_tokens"] == t["n_tokens"]
    assert ids(generate(a, clone["id"], 8)) == ids(generate(a, s["id"], 8))
    r = a.get(f"/v1/sessions/{s['id']}/transcript", params={"since_version": 2})
    assert [g["version"] for g in r.json()["segments"]] == [3, 4]


def test_rollback_and_fork_carry_the_right_lineage(a):
    s = create(a)
    generate(a, s["id"], 6)
    generate(a, s["id"], 6)
    a.post(f"/v1/sessions/{s['id']}/rollback", json={"version": 1})
    t = a.get(f"/v1/sessions/{s['id']}/transcript").json()
    assert [(g["kind"], g["version"]) for g in t["segments"]] == [
        ("create", 0),
        ("generate", 1),
        ("rollback", 3),
    ]
    assert t["segments"][-1]["restores"] == 1
    assert sum(len(g["ids"]) for g in t["segments"]) == t["n_tokens"]
    fork = a.post(f"/v1/sessions/{s['id']}/fork", json={"version": 2}).json()
    generate(a, fork["id"], 5)
    f = a.get(f"/v1/sessions/{fork['id']}/transcript").json()
    assert [(g["session_id"], g["kind"], g["version"]) for g in f["segments"]] == [
        (s["id"], "create", 0),
        (s["id"], "generate", 1),
        (s["id"], "generate", 2),
        (fork["id"], "fork", 0),
        (fork["id"], "generate", 1),
    ]
    assert f["complete"] and sum(len(g["ids"]) for g in f["segments"]) == f["n_tokens"]
