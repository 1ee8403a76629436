"""Keeping what was streamed: SSE `id:` fields name each token (version.index), and
`on_disconnect: "commit"` leaves a session that a client hung up on holding exactly the
tokens it was sent, committed fenced as usual; `discard` (the default) keeps nothing."""

from __future__ import annotations

import time

import httpx


def create(c: httpx.Client) -> dict:
    r = c.post("/v1/sessions", json={"prompt": "ROMEO:"})
    assert r.status_code == 201, r.text
    return r.json()


def raw_events(c: httpx.Client, sid: str, body: dict, take: int | None = None) -> list[dict]:
    """The stream's events as {field: value} (every field, `id` too); with `take`, hang up
    after that many token events."""
    out: list[dict] = []
    current: dict = {}
    with c.stream("POST", f"/v1/sessions/{sid}/generate", json={"stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == "":
                if current.get("event"):
                    out.append(current)
                current = {}
                if take is not None and sum(e["event"] == "token" for e in out) == take:
                    break  # leaving the block closes the connection mid-stream
            elif not line.startswith(":"):
                field, _, value = line.partition(":")
                current[field] = value.removeprefix(" ")
    return out


def settled(c: httpx.Client, sid: str) -> dict:
    """The session once the server has finished with the hung-up request (its lock free)."""
    deadline = time.monotonic() + 30
    while True:
        r = c.delete(f"/v1/sessions/{sid}", headers={"If-Match": '"999"'})  # never deletes: 409 or 412
        if r.status_code == 412:
            return c.get(f"/v1/sessions/{sid}").json()
        assert r.status_code == 409 and time.monotonic() < deadline, r.text
        time.sleep(0.05)


def test_events_carry_the_version_and_index_as_their_id(http):
    s = create(http)
    events = raw_events(http, s["id"], {"max_tokens": 4, "temperature": 0})
    tokens = [e for e in events if e["event"] == "token"]
    assert [e["id"] for e in tokens] == ["1.0", "1.1", "1.2", "1.3"]
    assert events[-1]["event"] == "done" and events[-1]["id"] == "1"


def test_commit_on_disconnect_keeps_exactly_the_tokens_sent(http):
    s = create(http)
    ref = http.post(f"/v1/sessions/{s['id']}/fork").json()["id"]
    # what an uninterrupted greedy generation gives
    whole = http.post(
        f"/v1/sessions/{ref}/generate", json={"stream": False, "max_tokens": 60, "temperature": 0}
    )
    want = [t["id"] for t in whole.json()["tokens"]]
    got = raw_events(http, s["id"], {"max_tokens": 1000, "temperature": 0, "on_disconnect": "commit"}, take=5)
    assert [e["id"] for e in got] == ["1.0", "1.1", "1.2", "1.3", "1.4"]
    # the server commits what it had sent when it saw the hang-up: at least what was read
    kept = settled(http, s["id"])
    assert kept["version"] == 1
    sent = kept["n_tokens"] - s["n_tokens"]
    assert 5 <= sent < 60
    # ... and the state is exactly the greedy stream's after that many tokens: continuing it
    # greedily gives the rest of the uninterrupted stream
    more = http.post(
        f"/v1/sessions/{s['id']}/generate",
        json={"stream": False, "max_tokens": 60 - sent - 1, "temperature": 0},
    )
    assert [t["id"] for t in more.json()["tokens"]][: 60 - sent - 2] == want[sent:58]


def test_discard_on_disconnect_keeps_nothing(http):
    s = create(http)
    raw_events(http, s["id"], {"max_tokens": 1000, "temperature": 0}, take=3)
    kept = settled(http, s["id"])
    assert kept["version"] == 0
    assert kept["n_tokens"] == s["n_tokens"]
