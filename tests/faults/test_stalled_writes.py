"""A stalling Redis, over every write: the answer is the truth.

A server with a short `redis_timeout` (0.3 s) on a Redis of its own; before the request,
the test arms a stall (tests/faults/stalling_redis_server.py): `DEBUG SLEEP` reaches
Redis just before the chosen script, which then times out in the server and still runs
when the stall ends. For each write (session create, generate, score, fork, rollback,
import, delete; Responses create and continue, background, cancel; conversation items;
the tenant's ledger around a create) the answer must match what Redis holds once the
stall is over:

- a 2xx says what the state now is (its version, its count, its status);
- any other error means nothing changed;
- `503 outcome_unknown` (an SSE `error` event of that type, once a stream has begun) comes
  with `Retry-After`, and the state is either of the two.

A stall shorter than the timeout is only slow: the write answers 2xx.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from app.store import scripts
from tests.app.sse_client import events
from tests.conftest import RedisProcess, ServerProcess

from .harness import store_for
from .stalling_redis_server import STALL_KEY

TIMEOUT = 0.3  # the server's redis_timeout
STALL = 0.8  # past the timeout (and past a retry's), so the script runs after the answer
SHORT = 0.1  # inside the timeout


@pytest.fixture(scope="module")
def red(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path_factory.mktemp("stalled-redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def srv(red: RedisProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with ServerProcess(
        Path("shakespeare"), tmp_path_factory.mktemp("stalled"), red.url,
        entry=("-m", "tests.faults.stalling_redis_server"),
        cpu_threads=1, redis_timeout=TIMEOUT, max_tokens=400, lock_lease_seconds=2,
        response_lease_seconds=3,
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def r(red: RedisProcess) -> Iterator[redis.Redis]:
    """The test's own client. It loads every script first, as a server that has served
    a while has: a stalled script's first run is then the write itself, not a NOSCRIPT."""
    client = redis.Redis.from_url(red.url)
    for name in scripts.SCRIPTS:
        client.script_load(scripts.source(name))
    yield client
    client.close()


@pytest.fixture(scope="module")
def c(srv: ServerProcess) -> Iterator[httpx.Client]:
    with srv.client() as client:
        yield client


@dataclass
class Answer:
    status: int
    type: str  # the error's type ('' for a 2xx)
    claims: Any  # for a 2xx: what it says the probed state now is
    retry_after: str | None = None


def answer(resp: httpx.Response, claims: Callable[[dict], Any]) -> Answer:
    if resp.is_success:
        return Answer(resp.status_code, "", claims(resp.json() if resp.content else {}))
    return Answer(resp.status_code, resp.json()["error"]["type"], None, resp.headers.get("retry-after"))


def new_session(c: httpx.Client, prompt: str = "To be") -> dict:
    resp = c.post("/v1/sessions", json={"prompt": prompt})
    assert resp.status_code == 201, resp.text
    return resp.json()


def version_of(c: httpx.Client, sid: str) -> tuple[int, int | None]:
    resp = c.get(f"/v1/sessions/{sid}")
    return resp.status_code, resp.json().get("version") if resp.status_code == 200 else None


def count(r: redis.Redis, pattern: str) -> int:
    """How many stored objects match (a deleted object's tombstone, owned by '-', is none)."""
    return sum(r.hget(k, "owner") != b"-" for k in r.scan_iter(match=pattern, count=1000))


# -- the writes -------------------------------------------------------------------------------
# each: (script to stall, set up -> context, send -> Answer, probe -> the state it changes)
Ctx = dict[str, Any]


def sessions_of(srv: ServerProcess, r: redis.Redis) -> int:
    return count(r, store_for(srv).session("*") + "*")  # (a fork's keys: {F}.HEX)


def responses_of(srv: ServerProcess, r: redis.Redis) -> int:
    return count(r, f"{srv.settings['key_prefix']}response:*")


def case_create(c, srv, r):
    def send(ctx):
        return answer(c.post("/v1/sessions", json={"prompt": "Hark"}), lambda _: ctx["n"] + 1)

    return send, lambda ctx: sessions_of(srv, r), {}


def case_generate(c, srv, r):
    sid = new_session(c)["id"]

    def send(ctx):
        resp = c.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 3, "stream": False})
        return answer(resp, lambda d: (200, d["session"]["version"]))

    return send, lambda ctx: version_of(c, sid), {}


def case_stream(c, srv, r):
    sid = new_session(c)["id"]

    def send(ctx):
        with c.stream("POST", f"/v1/sessions/{sid}/generate", json={"max_tokens": 3}) as resp:
            if resp.status_code != 200:
                resp.read()
                return answer(resp, lambda _: None)
            name, data = list(events(resp))[-1]
        if name == "done":
            return Answer(200, "", (200, data["session"]["version"]))
        # (a stream's headers went out before the commit: its Retry-After is in words)
        return Answer(200, data["error"]["type"], None, "stream")

    return send, lambda ctx: version_of(c, sid), {}


def case_score(c, srv, r):
    sid = new_session(c)["id"]

    def send(ctx):
        resp = c.post(f"/v1/sessions/{sid}/score", json={"prompt": " or not", "commit": True})
        return answer(resp, lambda d: (200, d["session"]["version"]))

    return send, lambda ctx: version_of(c, sid), {}


def case_fork(c, srv, r):
    sid = new_session(c)["id"]

    def send(ctx):
        return answer(c.post(f"/v1/sessions/{sid}/fork"), lambda _: ctx["n"] + 1)

    return send, lambda ctx: sessions_of(srv, r), {}


def case_rollback(c, srv, r):
    sid = new_session(c)["id"]
    assert c.post(f"/v1/sessions/{sid}/score", json={"prompt": "!", "commit": True}).status_code == 200

    def send(ctx):
        resp = c.post(f"/v1/sessions/{sid}/rollback", json={"version": 0})
        return answer(resp, lambda d: (200, d["version"]))

    return send, lambda ctx: version_of(c, sid), {}


def case_import(c, srv, r):
    sid = new_session(c)["id"]
    blob = c.get(f"/v1/sessions/{sid}/state").content

    def send(ctx):
        resp = c.post(
            "/v1/sessions/import", content=blob, headers={"content-type": "application/octet-stream"}
        )
        return answer(resp, lambda _: ctx["n"] + 1)

    return send, lambda ctx: sessions_of(srv, r), {}


def case_delete(c, srv, r):
    sid = new_session(c)["id"]

    def send(ctx):
        return answer(c.delete(f"/v1/sessions/{sid}"), lambda _: (404, None))

    return send, lambda ctx: version_of(c, sid), {}


def response_body(**extra: Any) -> dict:
    return {"input": "Speak", "max_output_tokens": 3, **extra}


def case_response(c, srv, r):
    def send(ctx):
        return answer(c.post("/v1/responses", json=response_body()), lambda _: ctx["n"] + 1)

    return send, lambda ctx: responses_of(srv, r), {}


def case_continue(c, srv, r):
    first = c.post("/v1/responses", json=response_body())
    assert first.status_code == 200, first.text

    def send(ctx):
        body = response_body(previous_response_id=first.json()["id"])
        return answer(c.post("/v1/responses", json=body), lambda _: ctx["n"] + 1)

    return send, lambda ctx: responses_of(srv, r), {}


def case_branch(c, srv, r):
    """A second continuation of one response: the chain went on from it, so this one forks
    its version (a `create`), where the first continued the chain's session in place."""
    first = c.post("/v1/responses", json=response_body())
    assert first.status_code == 200, first.text
    body = response_body(previous_response_id=first.json()["id"])
    assert c.post("/v1/responses", json=body).status_code == 200

    def send(ctx):
        return answer(c.post("/v1/responses", json=body), lambda _: ctx["n"] + 1)

    return send, lambda ctx: responses_of(srv, r), {}


def case_background(c, srv, r):
    def send(ctx):
        resp = c.post("/v1/responses", json=response_body(background=True))
        return answer(resp, lambda _: ctx["n"] + 1)

    return send, lambda ctx: responses_of(srv, r), {}


def case_cancel(c, srv, r):
    started = c.post("/v1/responses", json=response_body(background=True, max_output_tokens=400))
    assert started.status_code == 200, started.text
    rid = started.json()["id"]

    # what the cancel changes is whether the response is cancelled: its status alone can
    # also move by its worker, whose own writes meet the same stall (a queued response
    # then fails, and a cancel whose connection could not be opened truly did nothing)
    def send(ctx):
        return answer(c.post(f"/v1/responses/{rid}/cancel"), lambda d: d["status"] == "cancelled")

    def probe(ctx):
        return c.get(f"/v1/responses/{rid}").json()["status"] == "cancelled"

    return send, probe, {}


def case_items(c, srv, r):
    conv = c.post("/v1/conversations", json={"items": [{"role": "user", "content": "Speak"}]})
    assert conv.status_code == 200, conv.text
    cid = conv.json()["id"]

    def send(ctx):
        new = {"items": [{"role": "user", "content": "Again"}]}
        return answer(c.post(f"/v1/conversations/{cid}/items", json=new), lambda _: ctx["n"] + 1)

    def probe(ctx):
        return len(c.get(f"/v1/conversations/{cid}/items").json()["data"])

    return send, probe, {}


CASES: dict[str, tuple[str, Callable]] = {
    "create": ("create", case_create),
    "create-ledger": ("settle", case_create),  # the tenant's ledger, after the session's write
    "create-admission": ("record", case_create),  # the tenant's ledger, before it
    "generate": ("commit", case_generate),
    "generate-stream": ("commit", case_stream),
    "score": ("commit", case_score),
    "fork": ("fork", case_fork),
    "rollback": ("commit", case_rollback),
    "import": ("create", case_import),
    "delete": ("delete", case_delete),
    "response": ("object_save", case_response),
    "response-session": ("create", case_response),
    "continue": ("commit", case_continue),  # (in place, in the chain's session)
    "continue-branch": ("fork", case_branch),  # (a fork of the version continued)
    "continue-ledger": ("settle", case_continue),
    "continue-record": ("object_save", case_continue),
    "background": ("object_save", case_background),
    "cancel": ("response_cancel", case_cancel),
    "conversation-items": ("items_add", case_items),
}


def stall_then_send(
    r: redis.Redis, script: str, seconds: float, send: Callable[[Ctx], Answer], ctx: Ctx
) -> Answer:
    r.set(STALL_KEY, f"{script} {seconds}")
    try:
        got = send(ctx)
        assert not r.exists(STALL_KEY), f"the request never ran {script}"
        return got
    finally:
        r.delete(STALL_KEY)
        r.ping()  # (waits out the stall: the script it held has run)


@pytest.mark.parametrize("case", list(CASES))
def test_a_write_that_meets_a_stall_answers_its_outcome(case, c, srv, r):
    script, make = CASES[case]
    send, probe, ctx = make(c, srv, r)
    before = probe(ctx)
    ctx["n"] = before
    got = stall_then_send(r, script, STALL, send, ctx)
    after = probe(ctx)
    if not got.type:
        assert after == got.claims, (got, before, after)
    elif got.type == "outcome_unknown":
        assert got.retry_after, got
    else:
        assert after == before, f"{got.status} {got.type}, yet the state went from {before} to {after}"


@pytest.mark.parametrize("case", ["generate", "create", "delete", "conversation-items"])
def test_a_stall_inside_the_timeout_is_only_slow(case, c, srv, r):
    script, make = CASES[case]
    send, probe, ctx = make(c, srv, r)
    ctx["n"] = probe(ctx)
    got = stall_then_send(r, script, SHORT, send, ctx)
    assert not got.type, got
    assert probe(ctx) == got.claims


def test_an_unknown_outcome_names_what_to_read(c, srv, r):
    sid = new_session(c)["id"]
    r.set(STALL_KEY, f"commit {STALL}")
    try:
        resp = c.post(f"/v1/sessions/{sid}/score", json={"prompt": "!", "commit": True})
    finally:
        r.ping()
    assert resp.status_code == 503 and resp.json()["error"]["type"] == "outcome_unknown", resp.text
    assert int(resp.headers["retry-after"]) >= 1
    message = resp.json()["error"]["message"]
    assert sid in message and re.search(r"version 0\b.*\b1\b", message), message
    # the commit ran when the stall ended: the session is at version 1
    assert version_of(c, sid) == (200, 1)


def test_a_background_worker_rides_out_a_stall(c, srv, r):
    """A background worker whose event write meets a stall past the server's timeout
    retries it with the same op id once Redis answers (app/sessions/background.py,
    `_through_stalls`), rather than failing its response: the response completes, and its
    events replay each once, in order."""
    r.set(STALL_KEY, f"response_event {STALL}")  # (the worker's first event meets it)
    try:
        started = c.post("/v1/responses", json=response_body(background=True, max_output_tokens=20))
        assert started.status_code == 200, started.text
        rid = started.json()["id"]
        deadline = time.monotonic() + 60
        while (status := _status_through_stalls(c, rid)) in ("queued", "in_progress"):
            assert time.monotonic() < deadline, "the response never ended"
            time.sleep(0.1)
        assert not r.exists(STALL_KEY), "the worker's write never met the stall"
    finally:
        r.delete(STALL_KEY)
        r.ping()
    assert status in ("completed", "incomplete"), status
    with c.stream("GET", f"/v1/responses/{rid}", params={"stream": "true"}) as replay:
        numbers = [data["sequence_number"] for _, data in events(replay)]
    assert numbers == list(range(len(numbers))) and len(numbers) > 3, numbers


def _status_through_stalls(c, rid: str) -> str:
    """The response's status, or "in_progress" while the stall answers the read itself with
    `503 redis_unavailable` (a read that meets the stall cannot know it)."""
    got = c.get(f"/v1/responses/{rid}")
    if got.status_code == 503:
        assert got.json()["error"]["type"] == "redis_unavailable", got.text
        return "in_progress"
    assert got.status_code == 200, got.text
    return got.json()["status"]
