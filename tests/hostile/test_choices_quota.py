"""`n` choices at the edge of a key's session quota (issue 39): all or nothing.

A request with `n` choices makes its sessions one by one (a session of its own, then n - 1
forks), each admitted by the tenant's ledger. At the edge of the quota, with room for
exactly the n it needs, it must be served with n choices and leave the key at its limit;
with room for one fewer, it must be refused with 429 and leave the key as it found it.
Issue 39 found the first landing one short in 3 of 8 trials. The trials here run both
edges, stateless and on a named session, and count the key's sessions after each.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import redis

from .conftest import SMALL, as_key

QUOTA = 4  # SMALL's sessions
TRIALS = 8
RACERS = 4  # n=2 requests at once, with room for one of them


def _clear(c: httpx.Client) -> None:
    for s in c.get("/v1/sessions", params={"limit": 1000, "ephemeral": "true"}).json()["sessions"]:
        c.delete(f"/v1/sessions/{s['id']}")
    assert c.get("/v1/usage").json()["sessions"] == 0


def _hold(c: httpx.Client, k: int) -> list[str]:
    made = [c.post("/v1/sessions", json={"prompt": f"held {i}"}) for i in range(k)]
    assert all(r.status_code == 201 for r in made), [r.text for r in made]
    return [r.json()["id"] for r in made]


def _complete(c: httpx.Client, n: int, session: str | None = None) -> httpx.Response:
    body: dict = {"prompt": "the edge", "n": n, "max_tokens": 2}
    if session is not None:
        body["session_id"] = session
    return c.post("/v1/completions", json=body)


def test_n_choices_at_the_session_quota_edge_are_all_or_nothing(tenants):
    """Eight trials of each edge: room for exactly n (served, n choices, the key at its
    limit), room for n - 1 (429 quota_exceeded, the key as it was)."""
    outcomes = []
    with as_key(tenants, SMALL) as c:
        for trial in range(TRIALS):
            _clear(c)
            _hold(c, QUOTA - 2)
            fits = _complete(c, 2)
            used = c.get("/v1/usage").json()["sessions"]
            outcomes.append(("fits", trial, fits.status_code, len(fits.json().get("choices", [])), used))

            _clear(c)
            _hold(c, QUOTA - 1)
            over = _complete(c, 2)
            used = c.get("/v1/usage").json()["sessions"]
            outcomes.append(("over", trial, over.status_code, over.json().get("error", {}).get("type"), used))

            _clear(c)
            held = _hold(c, QUOTA - 1)
            named = _complete(c, 2, held[0])  # one fork: room for it exactly
            used = c.get("/v1/usage").json()["sessions"]
            outcomes.append(("named", trial, named.status_code, len(named.json().get("choices", [])), used))
        _clear(c)
    wrong = [
        o
        for o in outcomes
        if o[2:]
        not in {
            "fits": [(200, 2, QUOTA)],
            "over": [(429, "quota_exceeded", QUOTA - 1)],
            "named": [(200, 2, QUOTA)],
        }[o[0]]
    ]
    assert not wrong, wrong


def _lined_up(r: redis.Redis, requests: int) -> None:
    """Wait until `requests` scripts wait on Redis's write pause (at most 5 s), and a little
    longer, so that every request has reached its first write."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        waiting = [c for c in r.client_list() if "b" in c["flags"] and c["cmd"] in {"evalsha", "eval"}]
        if len(waiting) >= requests:
            break
        time.sleep(0.01)
    time.sleep(0.2)


def test_racing_requests_for_the_last_places_serve_one(tenants, redis_url):
    """Four n=2 requests at once, with room for exactly one of them, in eight trials: one is
    served with both its choices, the others refused with 429, and the key ends at its limit.
    Each made its own session and then raced for the last place with its fork: both forks
    were refused and neither was served (the trials before the fix: [429, 429] in 2 of 8).

    The race is made, not hoped for: Redis's writes are paused (`CLIENT PAUSE WRITE`) while
    the requests are sent, so that each waits at its first write (its tokens' reservation),
    and they go on together when the pause ends. Left to the clock, a loaded machine served
    them one after the other and a request that took its places one by one went unseen."""
    outcomes = []
    r = redis.Redis.from_url(redis_url)
    with as_key(tenants, SMALL) as c, ThreadPoolExecutor(RACERS) as pool:
        for _ in range(TRIALS):
            _clear(c)
            _hold(c, QUOTA - 2)
            r.execute_command("CLIENT", "PAUSE", 10_000, "WRITE")
            try:
                sent = [pool.submit(_complete, c, 2) for _ in range(RACERS)]
                _lined_up(r, RACERS)
            finally:
                r.execute_command("CLIENT", "UNPAUSE")
            answers = [f.result() for f in sent]
            served = [len(a.json()["choices"]) for a in answers if a.status_code == 200]
            refused = [a.json()["error"]["type"] for a in answers if a.status_code != 200]
            outcomes.append((served, refused, c.get("/v1/usage").json()["sessions"]))
        _clear(c)
    assert outcomes == [([2], ["quota_exceeded"] * (RACERS - 1), QUOTA)] * TRIALS, outcomes
