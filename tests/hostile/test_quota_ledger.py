"""The quota ledger follows every use of a session (issue 25, attack 4).

`GET /v1/sessions/{id}/state?version=N` (the read fork and prefix reuse make too)
re-armed a session's Redis TTL but not its tenant's ledger, so the ledger forgot live
sessions: a key limited to 4 sessions held 7, while /v1/usage and the listing showed 3.

Decided (docs/RELIABILITY.md): every use of a session re-arms its TTL, reads included,
and the ledger takes the expiry Redis set after every script that re-armed it. The test
walks every route that touches a session and checks after each that the ledger is exactly
what Redis holds: the same sessions, each with its expiry and its stored bytes, and
/v1/usage their count and sum.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import redis

from app.store import Keys, owner_of, tenant_of
from tests.app.sse_client import events
from tests.stored_pages import stored_bytes

from .conftest import LEDGER, SMALL, as_key


def _clear(c: httpx.Client) -> None:
    for s in c.get("/v1/sessions", params={"limit": 1000}).json()["sessions"]:
        c.delete(f"/v1/sessions/{s['id']}")


def test_reading_past_versions_keeps_sessions_in_their_keys_quota(tenants):
    """4 sessions of 2 s, kept alive for 3.5 s only by `GET .../state?version=0`: the key is
    still at its limit of 4 afterwards, and a fifth is refused."""
    with as_key(tenants, SMALL) as c:
        _clear(c)
        made = [c.post("/v1/sessions", json={"prompt": "x", "ttl_seconds": 2}).json()["id"] for _ in range(4)]
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.5:
            for sid in made:
                assert c.get(f"/v1/sessions/{sid}/state", params={"version": 0}).status_code == 200
            time.sleep(0.3)
        fifth = c.post("/v1/sessions", json={"prompt": "x", "ttl_seconds": 2})
        assert fifth.status_code == 429, fifth.text
        assert fifth.json()["error"]["type"] == "quota_exceeded"
        assert c.get("/v1/usage").json()["sessions"] == 4
        assert sorted(s["id"] for s in c.get("/v1/sessions").json()["sessions"]) == sorted(made)
        _clear(c)


def _mismatches(r: redis.Redis, prefix: str, key: str, c: httpx.Client) -> list[str]:
    """Where the key's ledger differs from the sessions Redis holds for it (empty: nowhere)."""
    owner = owner_of(key)
    tenant = tenant_of(owner)
    ledger = {
        m.decode(): score
        for m, score in r.zrange(f"{prefix}tenant:{{{tenant}}}:live", 0, -1, withscores=True)
    }
    sizes = {k.decode(): int(v) for k, v in r.hgetall(f"{prefix}tenant:{{{tenant}}}:bytes").items()}
    held = {}
    keys = Keys(prefix)
    for k in r.scan_iter(f"{prefix}session:*", count=1000):
        o, exp, hist, trans = r.hmget(k, "owner", "expires_at", "history_bytes", "transcript_bytes")
        if (o or b"").decode() == owner:
            sid = k.decode().split("{", 1)[1].replace("}", "")  # (a fork's: {F}.HEX)
            stored = stored_bytes(r, keys, sid) + int(hist or 0) + int(trans or 0)
            held[sid] = (float(exp), stored)
    out = []
    if set(ledger) != set(held):
        out.append(f"ledger sessions {sorted(ledger)} != Redis's {sorted(held)}")
    for sid in set(ledger) & set(held):
        expires, stored = held[sid]
        if abs(ledger[sid] - expires) > 0.002:
            out.append(f"{sid}: the ledger says it expires at {ledger[sid]:.3f}, Redis at {expires:.3f}")
        if sizes.get(sid) != stored:
            out.append(f"{sid}: the ledger says {sizes.get(sid)} bytes, Redis holds {stored}")
    usage = c.get("/v1/usage").json()
    total = sum(stored for _, stored in held.values())
    if (usage["sessions"], usage["state_bytes"]) != (len(held), total):
        out.append(
            f"/v1/usage says {usage['sessions']} sessions, {usage['state_bytes']} bytes; Redis {len(held)}, {total}"
        )
    return out


def _disconnect_after_first_token(c: httpx.Client, sid: str, on_disconnect: str) -> None:
    body = {"prompt": " and", "max_tokens": 400, "temperature": 0, "on_disconnect": on_disconnect}
    with c.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as r:
        assert r.status_code == 200
        assert next(events(r))[0] == "token"


def test_usage_equals_what_redis_holds_after_every_route(tenants, redis_url):
    prefix = str(tenants.settings["key_prefix"])
    r = redis.Redis.from_url(redis_url)
    with as_key(tenants, LEDGER) as c:
        _clear(c)
        ids: dict[str, str] = {}
        gen = {"stream": False, "max_tokens": 4, "temperature": 0}

        def create() -> None:
            ids["a"] = c.post("/v1/sessions", json={"prompt": "Once", "keep_versions": 4}).json()["id"]

        def fork(name: str, **body: int) -> Callable[[], None]:
            def go() -> None:
                ids[name] = c.post(f"/v1/sessions/{ids['a']}/fork", json=body or None).json()["id"]

            return go

        def imported() -> None:
            blob = c.get(f"/v1/sessions/{ids['a']}/state").content
            made = c.post(
                "/v1/sessions/import", content=blob, headers={"Content-Type": "application/octet-stream"}
            )
            ids["d"] = made.json()["id"]

        steps: list[tuple[str, Callable[[], object]]] = [
            ("create", create),
            ("get", lambda: c.get(f"/v1/sessions/{ids['a']}")),
            (
                "generate",
                lambda: c.post(f"/v1/sessions/{ids['a']}/generate", json={"prompt": " upon", **gen}),
            ),
            (
                "generate (stream)",
                lambda: list(
                    events(c.post(f"/v1/sessions/{ids['a']}/generate", json={**gen, "stream": True}))
                ),
            ),
            ("score", lambda: c.post(f"/v1/sessions/{ids['a']}/score", json={"prompt": " a"})),
            (
                "score (commit)",
                lambda: c.post(f"/v1/sessions/{ids['a']}/score", json={"prompt": " a", "commit": True}),
            ),
            ("export", lambda: c.get(f"/v1/sessions/{ids['a']}/state")),
            ("export at a version", lambda: c.get(f"/v1/sessions/{ids['a']}/state", params={"version": 1})),
            ("versions", lambda: c.get(f"/v1/sessions/{ids['a']}/versions")),
            ("transcript", lambda: c.get(f"/v1/sessions/{ids['a']}/transcript")),
            ("fork", fork("b")),
            ("fork at a version", fork("c", version=1)),
            ("rollback", lambda: c.post(f"/v1/sessions/{ids['a']}/rollback", json={"version": 2})),
            ("list", lambda: c.get("/v1/sessions")),
            ("import", imported),
            (
                "completion in a session",
                lambda: c.post(
                    "/v1/completions",
                    json={"model": "txl", "prompt": " the", "max_tokens": 3, "session_id": ids["a"]},
                ),
            ),
            (
                "stateless completion",
                lambda: c.post(
                    "/v1/completions", json={"model": "txl", "prompt": "Once upon a", "max_tokens": 3}
                ),
            ),
            (
                "stateless completion, reused",
                lambda: c.post(
                    "/v1/completions", json={"model": "txl", "prompt": "Once upon a time", "max_tokens": 3}
                ),
            ),
            ("a stream cut short, discarded", lambda: _disconnect_after_first_token(c, ids["b"], "discard")),
            ("a stream cut short, kept", lambda: _disconnect_after_first_token(c, ids["c"], "commit")),
            (
                "a refused write",
                lambda: c.post(f"/v1/sessions/{ids['a']}/generate", json=gen, headers={"If-Match": '"999"'}),
            ),
            ("delete", lambda: c.delete(f"/v1/sessions/{ids['b']}")),
        ]
        for name, step in steps:
            time.sleep(0.05)  # (so that each use moves the expiry)
            answer = step()
            if isinstance(answer, httpx.Response):
                assert answer.status_code < 500, (name, answer.text)
            deadline = time.monotonic() + 5  # (a stream's end runs just after its response)
            while (wrong := _mismatches(r, prefix, LEDGER, c)) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not wrong, (name, wrong)
        _clear(c)
