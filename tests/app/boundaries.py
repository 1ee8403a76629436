"""Boundary invariance at the API level, the check every family's server must pass (the
routes never know which family they serve): a text scored in one committed request, or
committed over many cut anywhere, gives the same per-token log-probs, and the two
sessions then generate alike."""

from __future__ import annotations

import itertools

import httpx
import pytest


def create(http: httpx.Client, **body: object) -> dict:
    """A new session (201), as the server describes it."""
    r = http.post("/v1/sessions", json=body or None)
    assert r.status_code == 201, r.text
    return r.json()


def assert_scored_alike(
    http: httpx.Client, ids: list[int], cuts: list[int], max_tokens: int, from_token: int = 0
) -> tuple[str, str, dict]:
    """Score `ids` into a new session in one request and into another in requests cut at
    `cuts`: their log-probs agree (from `from_token` on: a model whose first token has no
    context may score it differently) and greedy generations of `max_tokens` from the two
    committed states are the same. Returns the two sessions' ids (whole, split) and the split
    one as its last piece's commit left it (the `session` of the response)."""
    whole = create(http)["id"]
    r = http.post(f"/v1/sessions/{whole}/score", json={"prompt": ids, "commit": True})
    assert r.status_code == 200, r.text
    want = [t["logprob"] for t in r.json()["tokens"]]
    split = create(http)["id"]
    got: list[float] = []
    for a, b in itertools.pairwise([0, *sorted(cuts), len(ids)]):
        r = http.post(f"/v1/sessions/{split}/score", json={"prompt": ids[a:b], "commit": True})
        assert r.status_code == 200, r.text
        got += [t["logprob"] for t in r.json()["tokens"]]
    pieces = r.json()["session"]
    assert len(got) == len(want) == len(ids)
    assert got[from_token:] == pytest.approx(want[from_token:], abs=1e-4)
    body = {"stream": False, "max_tokens": max_tokens, "temperature": 0}
    generated = []
    for sid in (whole, split):
        r = http.post(f"/v1/sessions/{sid}/generate", json=body)
        assert r.status_code == 200, r.text
        generated.append([t["id"] for t in r.json()["tokens"]])
    assert generated[0] == generated[1]
    return whole, split, pieces
