"""The shipped defaults under load: what `make run` serves, on two replicas started together.

Replica A is `recur serve` as `make run` runs it: the shipped model, the embedded Redis,
every setting at its default (the hot cache, prefix reuse, delta persistence among them).
Replica B is the same, on A's Redis, started as soon as that Redis is up. Four clients
start the moment both answer, each with its own session, sending requests to the two
replicas in turn: 5,000-character scores that commit, streamed generates, and chat
completions through the official `openai` SDK (streamed and not, without a session: prefix
reuse serves them). The second case turns the background compile on (it is opt-in) and
keeps the load going until both replicas' compiles have finished, so that the compile
runs during the load, not before it.

Asserted: no 5xx, no transport error, no other refusal; every acknowledged commit present
in Redis, read through the other replica; no engine error in either server's log; and,
with the compile, both compiles `ready` (replicas on one host never spoil each other's).
Slow (minutes): `make test-slow`, which `.ci/run` runs after `make test`.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from app.config import Settings
from tests.app.sse_client import events
from tests.conftest import ServerProcess

pytestmark = pytest.mark.slow

CLIENTS, SCORE_CHARS, LOAD_SECONDS, COMPILE_LIMIT = 4, 5000, 60.0, 1200.0
DEFAULTS = {"key_prefix": Settings().key_prefix}  # (ServerProcess would give each server its own)
ENGINE_ERRORS = re.compile(r"Traceback|engine step failed|prefill failed|\"level\": \"error\"|ERROR")


@dataclass
class Tally:
    acked: dict[str, tuple[int, int]] = field(default_factory=dict)  # session -> (version, n_tokens)
    requests: int = 0
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)


def _text(i: int) -> str:
    line = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. "
    return (f"[{i}] " + line * (SCORE_CHARS // len(line) + 1))[:SCORE_CHARS]


def _stream(c: httpx.Client, sid: str, seed: int) -> dict:
    body = {"max_tokens": 32, "stream": True, "seed": seed, "temperature": 0.8}
    with c.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as r:
        if r.status_code != 200:
            raise AssertionError(f"generate {r.status_code} {r.read()[:300]!r}")
        last = list(events(r))[-1]
    assert last[0] == "done", last
    return last[1]["session"]


def _one(k: int, c: httpx.Client, oa: openai.OpenAI, sid: str, text: str) -> dict | None:
    """Request k of a client: the session it committed, or None (a chat without a session)."""
    if k % 3 == 0:
        r = c.post(f"/v1/sessions/{sid}/score", json={"prompt": text, "commit": True})
        assert r.status_code == 200, f"score {r.status_code} {r.text[:300]}"
        return dict(r.json()["session"])
    if k % 3 == 1:
        return _stream(c, sid, k)
    messages = [{"role": "user", "content": f"Speak, friend {k}."}]
    if k % 2:
        assert oa.chat.completions.create(model="shakespeare", messages=messages, max_tokens=16).choices
    else:
        chunks = oa.chat.completions.create(
            model="shakespeare", messages=messages, max_tokens=16, stream=True
        )
        assert any(ch.choices for ch in chunks)
    return None


def _client(i: int, replicas: list[ServerProcess], until: threading.Event, tally: Tally) -> None:
    clients = [srv.client() for srv in replicas]
    sdks = [srv.openai() for srv in replicas]
    sid = clients[0].post("/v1/sessions", json={"prompt": "ROMEO:"}).json()["id"]
    k = 0
    while not until.is_set():
        n = (i + k) % len(replicas)
        try:
            meta = _one(k, clients[n], sdks[n], sid, _text(i))
        except (httpx.TransportError, openai.APIConnectionError) as exc:
            tally.fail(f"transport error from replica {n}: {exc!r}")
        except (AssertionError, openai.APIStatusError) as exc:
            tally.fail(f"replica {n}: {exc}")
        else:
            with tally.lock:
                tally.requests += 1
                if meta is not None:
                    tally.acked[sid] = (meta["version"], meta["n_tokens"])
        k += 1
    for c in clients:
        c.close()


@pytest.fixture
def replicas(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[ServerProcess]]:
    """A and B, started together: B as soon as A's embedded Redis is up."""
    settings = {**DEFAULTS, **request.param}
    a = ServerProcess("shakespeare", tmp_path / "a", None, **settings)  # type: ignore[arg-type]
    b = None
    try:
        threading.Thread(target=a.start, args=(300,), daemon=True).start()
        deadline = time.monotonic() + 300
        while not (url := re.search(r"embedded redis-server at (redis://[^\s,]+)", a.log_tail(100_000))):
            assert time.monotonic() < deadline, a.log_tail()
            time.sleep(0.1)
        b = ServerProcess("shakespeare", tmp_path / "b", url.group(1), **settings)  # type: ignore[arg-type]
        b.start(300)
        while httpx.get(a.url + "/readyz", timeout=5).status_code != 200:  # (a.start's thread waits too)
            assert time.monotonic() < deadline, a.log_tail()
            time.sleep(0.1)
        yield [a, b]
    finally:
        for srv in (a, b):
            if srv is not None:
                srv.stop()


def _compile_state(srv: ServerProcess) -> str:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    return re.search(r'recur_decode_compile_state\{state="(\w+)"\} 1\.0', text).group(1)  # type: ignore[union-attr]


@pytest.mark.parametrize("replicas", [{}, {"compile": True}], ids=["defaults", "with-compile"], indirect=True)
def test_the_defaults_serve_a_mixed_load_on_two_replicas_without_a_failure(replicas):
    compiling = _compile_state(replicas[0]) != "off"
    tally, until = Tally(), threading.Event()
    threads = [
        threading.Thread(target=_client, args=(i, replicas, until, tally), daemon=True)
        for i in range(CLIENTS)
    ]
    for t in threads:
        t.start()
    began = time.monotonic()
    try:
        while time.monotonic() - began < LOAD_SECONDS or (
            compiling and any(_compile_state(s) == "compiling" for s in replicas)
        ):
            assert time.monotonic() - began < COMPILE_LIMIT, "the compiles did not finish"
            time.sleep(1)
    finally:
        until.set()
        for t in threads:
            t.join(600)
    assert not tally.failures, tally.failures[:10]
    assert tally.requests >= 3 * CLIENTS
    with replicas[1].client() as c:  # every acknowledged commit is in Redis, read through B
        for sid, (version, n_tokens) in tally.acked.items():
            meta = c.get(f"/v1/sessions/{sid}").json()
            assert (meta["version"], meta["n_tokens"]) == (version, n_tokens), sid
    for srv in replicas:
        log = srv.log_tail(10_000_000)
        assert not ENGINE_ERRORS.findall(log), ENGINE_ERRORS.findall(log)[:5]
        if compiling:
            assert _compile_state(srv) == "ready", log[-3000:]
