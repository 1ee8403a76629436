"""The session list as a user reads it: the caller's own sessions, newest first, each with
the start of its text; the ephemeral ones (a stateless completion's session, an `n`
choice's fork) only when asked for; pages that neither repeat nor skip a session."""

from __future__ import annotations

import time

import httpx

from .test_sessions import create


def _pages(http: httpx.Client, limit: int, **params: object) -> list[dict]:
    listed: list[dict] = []
    cursor: str | None = "0"
    while cursor is not None:
        r = http.get("/v1/sessions", params={"limit": limit, "cursor": cursor, **params})
        assert r.status_code == 200, r.text
        page = r.json()
        assert len(page["sessions"]) <= limit
        listed += page["sessions"]
        cursor = page["next_cursor"]
        assert len(listed) < 10_000
    return listed


def test_newest_first_with_previews_across_pages(http):
    made = [create(http, prompt=f"session number {i}")["id"] for i in range(7)]
    for limit in (2, 3, 1000):
        listed = _pages(http, limit)
        ids = [s["id"] for s in listed]
        assert len(ids) == len(set(ids)), "a session listed twice"
        mine = [s for s in listed if s["id"] in made]
        assert [s["id"] for s in mine] == made[::-1]  # newest first, every one of them
        assert [s["preview"] for s in mine] == [f"session number {i}" for i in reversed(range(7))]
        assert not any(s["ephemeral"] for s in mine)
    times = [s["created_at"] for s in _pages(http, 1000)]
    assert times == sorted(times, reverse=True)


def test_long_text_is_clipped(http):
    sid = create(http, prompt="x" * 300)["id"]
    listed = {s["id"]: s for s in _pages(http, 1000)}
    preview = listed[sid]["preview"]
    assert len(preview) == 80 and preview == "x" * 79 + "…"


def test_ephemeral_sessions_are_listed_only_when_asked(http):
    mine = create(http, prompt="a session of my own")["id"]
    r = http.post("/v1/completions", json={"prompt": "a stateless request", "max_tokens": 2})
    assert r.status_code == 200, r.text
    stateless = r.json()["session_id"]
    r = http.post("/v1/completions", json={"prompt": "more", "max_tokens": 2, "n": 2, "session_id": mine})
    assert r.status_code == 200, r.text
    forks = {c["session"]["id"] for c in r.json()["choices"]} - {mine}
    assert len(forks) == 1
    shown = {s["id"]: s for s in _pages(http, 1000)}
    assert mine in shown and stateless not in shown and not forks & set(shown)
    every = {s["id"]: s for s in _pages(http, 7, ephemeral=True)}
    assert every[stateless]["ephemeral"] and all(every[f]["ephemeral"] for f in forks)
    assert not every[mine]["ephemeral"]
    assert every[stateless]["preview"].startswith("a stateless request")
    assert set(shown) <= set(every)


def test_a_page_of_another_form_is_refused(http):
    for bad in ("1", "x", "12345" + "2" + "0" * 32, "1" * 18 + "0" + "a" * 32, "1" + "0" + "A" * 32):
        r = http.get("/v1/sessions", params={"cursor": bad})
        assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_request", (bad, r.text)


def test_an_expired_session_leaves_the_list(http):
    sid = create(http, prompt="short-lived", ttl_seconds=1)["id"]
    assert sid in {s["id"] for s in _pages(http, 1000)}
    deadline = time.monotonic() + 30
    while sid in {s["id"] for s in _pages(http, 1000)}:
        assert time.monotonic() < deadline, "an expired session is still listed"
        time.sleep(0.5)
