"""A bad row fails alone (issue 25, attacks 1 and 8).

Attack 1: an imported state claiming 2**63 - 8 consumed tokens (valid checksum, full
memory) overflowed inside the shared decode step, and the engine failed the whole batch:
another tenant lost most of its generations. Now every state is validated when it is
loaded (its token count within the family's bound), and a batched step that still fails
is retried row by row, so only the offending request fails.

Attack 8: a state full of 3e38 (finite, so it passed every check) was accepted; its first
generation committed a NaN state, which then failed fork and export with 500. Now a step
that produces non-finite values fails its request clearly and commits nothing.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import model
from app.engine import Request, Stored
from model.sampling import SamplingParams
from model.state import Persist
from tests.app.engine_requests import engine_for
from tests.faults.harness import stream_events

from .conftest import assert_error
from .states import NEAR_INT64_MAX, blob_with, full_state

FAMILIES = ["txl", "rlt"]
IMPORT = {"Content-Type": "application/octet-stream"}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_row_whose_step_fails_fails_alone_in_a_shared_batch(hostile_models, family):
    """The engine itself: a row that reached the batch with a token count at int64's edge
    (a live state, as the hot cache holds them: loading validates everything else) fails;
    the three rows decoded beside it finish every token."""
    lm, state = full_state(hostile_models[family])
    good = Stored(state.to_bytes(), (), int(state.n_tokens[0]))
    bad = state.replace(n_tokens=torch.tensor([NEAR_INT64_MAX]))

    async def go() -> list[object]:
        engine = engine_for(lm, cpu_threads=1)
        reqs = [
            Request(start, [5, 6], SamplingParams(temperature=0.0), None, 12, [], persist=Persist())
            for start in (good, good, bad, good)
        ]
        for r in reqs:  # all queued before the engine starts: they share every step
            engine.submit(r)
        engine.start()
        try:
            return await asyncio.gather(*(r.finished() for r in reqs), return_exceptions=True)
        finally:
            engine.stop()

    results = asyncio.run(go())
    assert isinstance(results[2], Exception), results[2]
    for res in (results[0], results[1], results[3]):
        assert not isinstance(res, BaseException), res
        assert len(res.token_ids) == 12 and res.state.finite()


@pytest.mark.parametrize("family", FAMILIES)
def test_an_import_claiming_2_63_tokens_is_refused_and_others_keep_generating(
    hostile_servers, hostile_models, family
):
    server = hostile_servers[family]
    blob = blob_with(hostile_models[family], n_tokens=NEAR_INT64_MAX)
    victim_failures: list[tuple[int, str]] = []
    victim_done = 0
    stop = threading.Event()

    def victim() -> None:
        nonlocal victim_done
        with server.client() as c:
            sid = c.post("/v1/sessions", json={"prompt": "Once"}).json()["id"]
            while not stop.is_set():
                r = c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": 8})
                if r.status_code != 200:
                    victim_failures.append((r.status_code, r.text[:200]))
                victim_done += 1

    t = threading.Thread(target=victim)
    t.start()
    try:
        with server.client() as c:
            for _ in range(5):
                r = c.post("/v1/sessions/import", content=blob, headers=IMPORT)
                if r.status_code == 201:  # (what happened before: then it generates in the shared batch)
                    c.post(f"/v1/sessions/{r.json()['id']}/generate", json={"stream": False, "max_tokens": 8})
                assert_error(r, 422, "invalid_state")
                assert "past the most a stream" in r.json()["error"]["message"]
    finally:
        stop.set()
        t.join()
    assert victim_done > 0 and victim_failures == []


@pytest.mark.parametrize("family", FAMILIES)
def test_a_state_whose_step_turns_non_finite_is_never_committed(hostile_servers, hostile_models, family):
    server = hostile_servers[family]
    with server.client() as c:
        r = c.post(
            "/v1/sessions/import", content=blob_with(hostile_models[family], fill=3e38), headers=IMPORT
        )
        assert r.status_code == 201, r.text  # finite: a valid state, as far as anyone can tell
        sid = r.json()["id"]
        r = c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": 4})
        assert_error(r, 422, "invalid_state")
        assert "non-finite" in r.json()["error"]["message"]
        status, evs = stream_events(c, f"/v1/sessions/{sid}/generate", {"prompt": "x", "max_tokens": 4})
        assert status == 200 and evs[-1][0] == "error" and evs[-1][1]["error"]["type"] == "invalid_state"
        r = c.post(f"/v1/sessions/{sid}/score", json={"prompt": "abc", "commit": True})
        assert_error(r, 422, "invalid_state")
        # the session stays at its last good version: it exports and forks as it was imported
        assert c.get(f"/v1/sessions/{sid}").json()["version"] == 0
        exported = c.get(f"/v1/sessions/{sid}/state")
        assert exported.status_code == 200
        st = model.load(hostile_models[family], device="cpu").load_state(exported.content)
        assert (
            st.finite() and float(next(t for t in st.tensors.values() if t.is_floating_point()).max()) > 1e38
        )
        assert c.post(f"/v1/sessions/{sid}/fork").status_code == 201
        # and the server serves everyone else as before
        other = c.post("/v1/sessions", json={"prompt": "Hi"}).json()["id"]
        assert (
            c.post(f"/v1/sessions/{other}/generate", json={"stream": False, "max_tokens": 4}).status_code
            == 200
        )
