"""Faults in the engine thread and in a route, injected by a test-only wrapper of the
server (`tests/faults/faulty_server.py`; no setting exposes them): a forward that raises, a
forward that hangs past the step deadline, a background compile that raises, a compiled
step that raises at serve time, and an error no handler knows. Each fails only the request
it concerns, with a clear error and nothing committed, and the next request succeeds.
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.app.sse_client import generate
from tests.conftest import ServerProcess

from .faulty_server import UNEXPECTED_ID
from .harness import error_type

DEADLINE, HANG, SLOW = 2.0, 6.0, 1.5
COMMON = dict(cpu_threads=1, max_tokens=64)


def _faulty(model_dir: Path, redis_url: str, workdir: Path, faults: str, **settings: object) -> ServerProcess:
    return ServerProcess(
        model_dir,
        workdir,
        redis_url,
        entry=("-m", "tests.faults.faulty_server", faults),
        **COMMON,
        **settings,
    )


@pytest.fixture(scope="module")
def faulty(tiny_model_dir, redis_url, tmp_path_factory) -> Iterator[ServerProcess]:
    faults = f"raise,hang={HANG},slow={SLOW},route"
    workdir = tmp_path_factory.mktemp("faulty")
    with _faulty(tiny_model_dir, redis_url, workdir, faults, engine_step_deadline=DEADLINE) as srv:
        yield srv


def _session(c: httpx.Client) -> str:
    r = c.post("/v1/sessions", json={"prompt": "To be"})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def _version(c: httpx.Client, sid: str) -> int:
    r = c.get(f"/v1/sessions/{sid}")
    assert r.status_code == 200, r.text
    return int(r.json()["version"])


def test_a_forward_that_raises_fails_its_request_alone_and_commits_nothing(faulty):
    with faulty.client() as c:
        sid = _session(c)
        r = c.post(f"/v1/sessions/{sid}/score", json={"prompt": "or not ~ to be", "commit": True})
        assert r.status_code == 500 and error_type(r) == "internal_error", r.text
        message = r.json()["error"]["message"]
        assert "the model failed" in message and "nothing of the request was committed" in message
        assert "Traceback" not in r.text and "injected" not in r.text  # the log has it, not the client
        tokens, end, data = generate(c, sid, prompt="~", max_tokens=4)
        assert (tokens, end, data["error"]["type"]) == ([], "error", "internal_error")
        assert _version(c, sid) == 0  # nothing committed, and no lock left behind:
        r = c.post(f"/v1/sessions/{sid}/score", json={"prompt": "or not to be", "commit": True})
        assert r.status_code == 200 and r.json()["session"]["version"] == 1, r.text
    assert "injected fault: the forward raised" in faulty.log_tail(200_000)


def test_a_forward_that_hangs_fails_its_requests_at_the_deadline_and_the_engine_recovers(faulty):
    with faulty.client() as c:
        sid = _session(c)
        answer: dict[str, httpx.Response] = {}

        def hung() -> None:
            answer["r"] = c.post(f"/v1/sessions/{sid}/score", json={"prompt": "^ hangs", "commit": True})

        began = time.monotonic()
        t = threading.Thread(target=hung)
        t.start()
        t.join(HANG + 30)
        r = answer["r"]
        assert r.status_code == 503 and error_type(r) == "engine_stalled", r.text
        assert "Retry-After" in r.headers
        # (timings are asserted loosely, against the injected hang, never against the machine)
        assert time.monotonic() - began < HANG, "the request waited for the hang instead of its deadline"
        ready = c.get("/readyz")  # the step still hangs: not ready, and new work is refused at once
        assert ready.status_code == 503 and error_type(ready) == "engine_stalled", ready.text
        refused = c.post(f"/v1/sessions/{sid}/score", json={"prompt": "x"})
        assert refused.status_code == 503 and error_type(refused) == "engine_stalled"
        deadline = time.monotonic() + HANG + 30
        while c.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the engine never recovered from the hung step"
            time.sleep(0.2)
        assert _version(c, sid) == 0
        r = c.post(f"/v1/sessions/{sid}/score", json={"prompt": "or not to be", "commit": True})
        assert r.status_code == 200 and r.json()["session"]["version"] == 1, r.text


def test_an_unexpected_error_answers_500_and_leaves_the_connection_usable(faulty):
    """One keep-alive connection: a request that meets an error no handler knows gets a 500
    JSON body, and the next request on the same connection succeeds (uvicorn used to drop
    a connection whose app raised, resetting the client's next request)."""
    url = urlparse(faulty.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.request("GET", f"/v1/sessions/{UNEXPECTED_ID}")
        first = conn.getresponse()
        body = first.read()
        assert first.status == 500 and b'"internal_error"' in body and b"request id" in body
        assert first.getheader("connection", "").lower() != "close"
        sock = conn.sock
        conn.request("GET", "/healthz")
        second = conn.getresponse()
        assert second.status == 200 and b'"ok"' in second.read()
        assert conn.sock is sock  # the same connection served both
    finally:
        conn.close()


def _hung_up(c: httpx.Client, path: str, body: dict) -> None:
    """POST `body`, and hang up before the (slow) answer comes."""
    with pytest.raises(httpx.TimeoutException):
        c.post(path, json=body, timeout=SLOW / 3)


def _settled(c: httpx.Client, sid: str) -> dict:
    """The session once the slow step it was given has ended (and any commit after it)."""
    time.sleep(SLOW + 1.0)
    r = c.get(f"/v1/sessions/{sid}")
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_a_score_or_create_whose_client_hung_up_commits_nothing(faulty):
    with faulty.client() as c:
        sid = _session(c)
        before = c.get(f"/v1/sessions/{sid}/transcript").json()
        _hung_up(c, f"/v1/sessions/{sid}/score", {"prompt": "`slow", "commit": True})
        assert _settled(c, sid)["version"] == 0
        assert c.get(f"/v1/sessions/{sid}/transcript").json() == before
        sessions = c.get("/v1/usage").json()["sessions"]
        _hung_up(c, "/v1/sessions", {"prompt": "`slow"})
        time.sleep(SLOW + 1.0)
        assert c.get("/v1/usage").json()["sessions"] == sessions  # no session was made
        # the session is free and whole: the next score commits as version 1
        r = c.post(f"/v1/sessions/{sid}/score", json={"prompt": "`slow", "commit": True})
        assert r.status_code == 200 and r.json()["session"]["version"] == 1, r.text


def test_a_score_that_asked_to_keep_its_work_commits_after_its_client_hung_up(faulty):
    with faulty.client() as c:
        sid = _session(c)
        body = {"prompt": "`kept", "commit": True, "on_disconnect": "commit"}
        _hung_up(c, f"/v1/sessions/{sid}/score", body)
        meta = _settled(c, sid)
        assert meta["version"] == 1
        segments = c.get(f"/v1/sessions/{sid}/transcript").json()["segments"]
        assert segments[-1]["kind"] == "score" and segments[-1]["text"] == "`kept"


def _metric(text: str, line_start: str) -> float:
    return float(next(ln for ln in text.splitlines() if ln.startswith(line_start)).split()[-1])


def _greedy(c: httpx.Client, prompt: str) -> list[int]:
    sid = _session(c)
    tokens, end, _ = generate(c, sid, prompt=prompt, max_tokens=12, temperature=0)
    assert end == "done"
    return [t["id"] for t in tokens]


def _wait_compile_state(c: httpx.Client, state: str) -> None:
    """Until /metrics says the background compile is in `state` (within a minute)."""
    deadline = time.monotonic() + 60
    while f'recur_decode_compile_state{{state="{state}"}} 1.0' not in (m := c.get("/metrics").text):
        assert time.monotonic() < deadline, m[-2000:]
        time.sleep(0.2)


def test_a_compile_that_raises_leaves_the_eager_step_serving(faulty, tiny_model_dir, redis_url, tmp_path):
    expected = _greedy(faulty.client(), "Whether 'tis nobler")
    with _faulty(tiny_model_dir, redis_url, tmp_path, "compile", compile=True) as srv, srv.client() as c:
        _wait_compile_state(c, "failed")
        assert _greedy(c, "Whether 'tis nobler") == expected
    assert "injected fault: the compile raised" in srv.log_tail(200_000)


def test_a_compiled_step_that_raises_at_serve_time_is_dropped_for_the_eager_one(
    faulty, tiny_model_dir, redis_url, tmp_path
):
    expected = _greedy(faulty.client(), "Whether 'tis nobler")
    with _faulty(tiny_model_dir, redis_url, tmp_path, "compiled", compile=True) as srv, srv.client() as c:
        _wait_compile_state(c, "ready")
        assert _greedy(c, "Whether 'tis nobler") == expected  # its first step met the fault
        m = c.get("/metrics").text
        assert _metric(m, "recur_decode_compiled_steps_total") >= 1
        assert 'recur_decode_compile_state{state="failed"} 1.0' in m
        assert _metric(m, 'recur_decode_compiled{batch="1"}') == 0.0
        assert _greedy(c, "Whether 'tis nobler") == expected
    assert "injected fault: the compiled step raised" in srv.log_tail(200_000)
