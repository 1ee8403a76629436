"""Connections without limits (issue 39, item 5): one address, with no key, opened slowloris
connections (a request head started, a header line trickled now and then, never finished)
until the server ran out of file descriptors; new clients timed out.

Now one address holds at most `max_connections_per_address` connections (the rest are
answered `429 queue_full` and closed at once), a head not complete `header_timeout` seconds
after the connection opened is cut however it trickles, and the log says so in a line every
10 s, not a line a connection. `make test` runs the attack at the scale of a small limit; the
`slow` test runs the issue's 20,000 connections against the defaults.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, ServerProcess
from tests.hostile.slowloris import Slowloris

PER_ADDRESS, HEAD_TIMEOUT = 20, 2
SETTINGS = dict(
    cpu_threads=1,
    max_tokens=8,
    max_prompt_tokens=300,
    max_connections_per_address=PER_ADDRESS,
    header_timeout=HEAD_TIMEOUT,
)
# the victim's own address: Linux routes all of 127/8 to the loopback device
VICTIM_ADDRESS = "127.0.0.2"


@pytest.fixture(scope="module")
def guarded(
    hostile_models: dict[str, Path], redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with ServerProcess(
        hostile_models["txl"], tmp_path_factory.mktemp("slowloris"), redis_url, **SETTINGS
    ) as s:
        yield s


def victim(server: ServerProcess) -> httpx.Client:
    transport = httpx.HTTPTransport(local_address=VICTIM_ADDRESS)
    return httpx.Client(base_url=server.url, timeout=60, transport=transport)


def served(c: httpx.Client) -> None:
    """A client from another address gets every route it asks for."""
    for _ in range(5):
        assert c.get("/healthz").status_code == 200
    sid = c.post("/v1/sessions", json={"prompt": "Hello"}).json()["id"]
    r = c.post(f"/v1/sessions/{sid}/generate", json={"stream": False, "max_tokens": 4})
    assert r.status_code == 200, r.text


def until(condition, attack: Slowloris, seconds: float = 60) -> None:
    """Trickle until `condition()` holds (a generous bound: the machine may be loaded)."""
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, (len(attack.open), attack.closed)
        attack.trickle()
        time.sleep(0.25)


def test_one_address_holds_at_most_its_limit_and_others_are_served(guarded: ServerProcess) -> None:
    logged = guarded.log.stat().st_size
    attack = Slowloris(guarded.port)
    try:
        attack.connect(5 * PER_ADDRESS)
        until(lambda: len(attack.open) <= PER_ADDRESS, attack)
        # exactly the limit is held; every connection past it was answered and closed at once
        assert len(attack.open) == PER_ADDRESS and attack.failed == 0
        assert attack.closed == 4 * PER_ADDRESS
        # (a refusal closes a socket holding the unread head: the kernel may reset it before
        # the client reads the answer, so most, not all, read it)
        refusals = [a for a in attack.answers if a.startswith(b"HTTP/1.1 429")]
        assert len(refusals) >= 2 * PER_ADDRESS, attack.answers[:3]
        body = json.loads(refusals[0].partition(b"\r\n\r\n")[2])
        assert body["error"]["type"] == "queue_full" and "address" in body["error"]["message"]

        with victim(guarded) as c:
            served(c)  # while the attacker holds its connections

        # the held heads trickle on, and are cut all the same
        until(lambda: not attack.open, attack)
        assert attack.closed == 5 * PER_ADDRESS
    finally:
        attack.close()
    # the address may connect again, and is served
    with guarded.client() as c:
        assert c.get("/healthz").status_code == 200
    # the log counts the attack in a few lines, not a line a connection
    log = guarded.log.read_text(errors="replace")[logged:]
    lines = [ln for ln in log.splitlines() if "connections refused or cut" in ln]
    assert 1 <= len(lines) <= 3, lines
    assert "Traceback" not in log


def test_a_connection_that_sends_nothing_is_cut(guarded: ServerProcess) -> None:
    attack = Slowloris(guarded.port)
    try:
        attack.connect(1)
        until(lambda: not attack.open, attack, seconds=60)
    finally:
        attack.close()


def test_a_keep_alive_client_sends_many_requests_on_one_connection(guarded: ServerProcess) -> None:
    """The head deadline is per request: a client that keeps its connection for longer than
    it, asking one request after another, is never cut mid-request."""
    with victim(guarded) as c:
        for _ in range(3):
            assert c.get("/healthz").status_code == 200
            time.sleep(HEAD_TIMEOUT / 2)
        sid = c.post("/v1/sessions", json={"prompt": "Hi"}).json()["id"]
        assert c.get(f"/v1/sessions/{sid}").status_code == 200


@pytest.mark.slow
def test_twenty_thousand_slowloris_connections_leave_healthz_fast(
    hostile_models: dict[str, Path], redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The issue's attack at its size, against the default limits: 20,000 connections from
    one address (two attacker processes, each under the open-file limit), trickling."""
    with ServerProcess(
        hostile_models["txl"], tmp_path_factory.mktemp("slowloris-20k"), redis_url, cpu_threads=1
    ) as server:
        logged = server.log.stat().st_size
        attackers = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.hostile.slowloris", str(server.port), "10000", "40"],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        try:
            time.sleep(15)  # both have made their connections, and trickle
            took = []
            with victim(server) as c:
                for _ in range(50):
                    t0 = time.perf_counter()
                    assert c.get("/healthz").status_code == 200
                    took.append(time.perf_counter() - t0)
                    time.sleep(0.1)
                served(c)
            results = [json.loads(a.communicate(timeout=120)[0]) for a in attackers]
        finally:
            for a in attackers:
                a.kill()
        print("healthz ms: median", 1000 * statistics.median(took), "max", 1000 * max(took), results)
        # the bar: a stated requirement, measured as a median over 50 probes
        assert statistics.median(took) < 0.1
        assert sum(r["made"] for r in results) >= 19_000, results
        assert sum(r["open_at_end"] for r in results) == 0, results  # cut, however they trickled
        grew = server.log.stat().st_size - logged
        assert grew < 64 * 1024, grew
