"""Token buckets reserve before running (issue 25, attack 9).

Concurrent requests all entered while the key's token bucket was positive: on a 50
tokens/s key, 5 concurrent requests made 10,240 tokens in 20 s, then the key was locked
out for minutes. Now a request reserves max_tokens x n at admission, only while the bucket
is out of debt, and gets back at its end what it did not draw.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from tests.app.sse_client import events

from .conftest import SLOW, as_key

RATE = 50  # the SLOW key's tokens per second (conftest.KEYS)
MAX_TOKENS = 200
GEN = {"stream": False, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}


def _wait_for_a_full_bucket() -> None:
    time.sleep(1 + (MAX_TOKENS + 20) / RATE)  # whatever an earlier test left it owing, and a second's worth


def test_concurrent_requests_cannot_overdraw_the_token_bucket(tenants):
    with as_key(tenants, SLOW) as c:
        sids = [c.post("/v1/sessions", json={"prompt": "x"}).json()["id"] for _ in range(5)]
        _wait_for_a_full_bucket()
        with ThreadPoolExecutor(5) as pool:
            answers = list(pool.map(lambda sid: c.post(f"/v1/sessions/{sid}/generate", json=GEN), sids))
        ok = [r for r in answers if r.status_code == 200]
        refused = [r for r in answers if r.status_code == 429]
        assert len(ok) + len(refused) == 5, [r.text for r in answers]
        made = sum(r.json()["usage"]["completion_tokens"] for r in ok)
        # one second's worth of tokens, and at most one request's reservation past it
        assert made <= RATE + MAX_TOKENS, made
        assert len(ok) == 1
        for r in refused:
            assert r.json()["error"]["type"] == "quota_exceeded"
            assert "tokens per second" in r.json()["error"]["message"]
            assert 1 <= int(r.headers["retry-after"]) <= 1 + MAX_TOKENS // RATE


def test_what_a_generation_does_not_draw_goes_back(tenants):
    """A stream of max_tokens 200 cut short after its first token draws a token or two: the
    rest of its reservation goes back, so the key's next request passes at once."""
    with as_key(tenants, SLOW) as c:
        sid = c.post("/v1/sessions", json={"prompt": "x"}).json()["id"]
        _wait_for_a_full_bucket()
        body = {**GEN, "stream": True, "on_disconnect": "discard"}
        with c.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as r:
            assert r.status_code == 200
            assert next(events(r))[0] == "token"
        time.sleep(0.5)  # (the run's end gives the tokens back just after the connection closes)
        r = c.post(f"/v1/sessions/{sid}/generate", json={**GEN, "max_tokens": 5})
        assert r.status_code == 200, r.text
