"""`/metrics` (Prometheus text format, parsed with prometheus-client's own parser) and the
structured JSON logs, over real HTTP against `python -m app`."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.api import create_app
from app.config import Settings
from app.engine import malloc
from tests.conftest import serve_in_process

from .sse_client import events, generate

GENERATE = "/v1/sessions/{session_id}/generate"
SERVER_SETTINGS = {"max_tokens": 100_000}  # so a generation is still running while scraped


def scrape(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_generation_metrics_count_what_happened(http):
    before = scrape(http)
    sid = http.post("/v1/sessions", json={"prompt": "abc"}).json()["id"]
    tokens, final, done = generate(http, sid, max_tokens=7, temperature=0)
    assert final == "done" and len(tokens) == 7
    r = http.post(
        f"/v1/sessions/{sid}/generate", json={"max_tokens": 5, "stream": False, "prompt": "de", "seed": 1}
    )
    assert r.status_code == 200
    assert http.get("/v1/sessions/" + "0" * 32).status_code == 404
    ok = {"method": "POST", "route": GENERATE, "status": "200"}
    # a streamed response is counted once its body has been sent, and the scheduler
    # lets a finished row go just after its last token: wait (boundedly) for both
    deadline = time.monotonic() + 30
    while True:
        after = scrape(http)
        settled = value(after, "recur_http_requests_total", **ok) - value(
            before, "recur_http_requests_total", **ok
        )
        if (settled >= 2 and value(after, "recur_num_requests_running") == 0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("recur_http_requests_total", **ok) == 2
    assert delta("recur_http_requests_total", method="POST", route="/v1/sessions", status="201") == 1
    assert (
        delta("recur_http_requests_total", method="GET", route="/v1/sessions/{session_id}", status="404") == 1
    )
    assert delta("recur_http_request_duration_seconds_count", method="POST", route=GENERATE) == 2
    assert delta("recur_generation_tokens_total") == 12
    assert delta("recur_prompt_tokens_total") == 2
    assert delta("recur_time_to_first_token_seconds_count") == 2
    assert delta("recur_inter_token_latency_seconds_count") == (7 - 1) + (5 - 1)
    assert delta("recur_time_to_first_token_seconds_sum") > 0
    assert delta("recur_e2e_request_latency_seconds_count") == 2
    assert delta("recur_request_success_total", finished_reason="length") == 2
    # no session id ever becomes a label value
    assert sid not in http.get("/metrics").text
    # idle now: nothing running, nothing queued; every other family is exported
    assert value(after, "recur_num_requests_running") == 0
    assert value(after, "recur_num_requests_waiting") == 0
    names = {name for name, _ in after}
    for family in (
        "recur_state_bytes_read_total",
        "recur_state_bytes_written_total",
        "recur_hot_cache_hits_total",
        "recur_hot_cache_misses_total",
        "recur_redis_errors_total",
    ):
        assert family in names, family


def test_the_batch_gauge_sees_a_running_generation(http, server):
    sid = http.post("/v1/sessions", json={"prompt": "abc"}).json()["id"]
    body = {"prompt": "go on\n", "max_tokens": 100_000, "temperature": 0}
    with server.client() as other, other.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as r:
        stream = events(r)  # (kept: a dropped generator would close the connection)
        assert next(stream)[0] == "token"
        running = scrape(http)
        assert value(running, "recur_num_requests_running") == 1
    # the client hung up: the generation leaves the batch within a step
    deadline = time.monotonic() + 30
    while value(scrape(http), "recur_num_requests_running") != 0:
        assert time.monotonic() < deadline, "the abandoned generation never left the batch"
        time.sleep(0.05)
    assert http.get(f"/v1/sessions/{sid}").json()["version"] == 0


def test_the_hot_cache_gauges_follow_its_sessions(http):
    before = scrape(http)
    sid = http.post("/v1/sessions", json={"prompt": "abc"}).json()["id"]
    made = scrape(http)
    assert value(made, "recur_hot_cache_sessions") == value(before, "recur_hot_cache_sessions") + 1
    assert value(made, "recur_hot_cache_bytes") > value(before, "recur_hot_cache_bytes")
    assert http.delete(f"/v1/sessions/{sid}").status_code == 204
    gone = scrape(http)
    assert value(gone, "recur_hot_cache_sessions") == value(before, "recur_hot_cache_sessions")
    assert value(gone, "recur_hot_cache_bytes") == value(before, "recur_hot_cache_bytes")


@pytest.mark.skipif(malloc._TRIM is None, reason="no malloc_trim in this C library")
def test_the_malloc_trim_counters_count_the_engines_releases(http):
    before = scrape(http)
    sid = http.post("/v1/sessions", json={"prompt": "abc"}).json()["id"]
    assert generate(http, sid, max_tokens=3, temperature=0)[1] == "done"
    # the engine gives the freed memory back once the process has been quiet a while
    deadline = time.monotonic() + 30
    while value(after := scrape(http), "recur_malloc_trims_total") == value(
        before, "recur_malloc_trims_total"
    ):
        assert time.monotonic() < deadline, "the idle engine never released memory"
        time.sleep(0.05)
    assert value(after, "recur_malloc_trims_total") > value(before, "recur_malloc_trims_total")
    assert value(after, "recur_malloc_trim_seconds_total") > value(before, "recur_malloc_trim_seconds_total")


def test_json_logs_carry_request_and_session_ids(http, server):
    sid = http.post("/v1/sessions").json()["id"]
    r = http.post(
        f"/v1/sessions/{sid}/generate",
        json={"max_tokens": 2, "stream": False},
        headers={"X-Request-Id": "req-test-42"},
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "req-test-42"
    # a request id that is not a sane token is replaced, never echoed
    r = http.get("/healthz", headers={"X-Request-Id": "bad id\twith spaces"})
    rid = r.headers["x-request-id"]
    assert rid != "bad id\twith spaces" and len(rid) == 32

    def records() -> list[dict]:
        lines = server.log.read_text().splitlines()
        return [json.loads(ln) for ln in lines if ln.startswith("{")]

    # the access line is written just after the response is sent: wait (boundedly) for both
    deadline = time.monotonic() + 10
    while True:
        logged = records()
        mine = [x for x in logged if x.get("request_id") == "req-test-42"]
        health = [x for x in logged if x.get("request_id") == rid and x.get("path") == "/healthz"]
        if (mine and health) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    access = [x for x in mine if x["logger"] == "recur.access"]
    assert len(access) == 1
    line = access[0]
    assert line["session_id"] == sid and line["status"] == 200 and line["route"] == GENERATE
    assert line["method"] == "POST" and line["level"] == "info" and line["duration_ms"] >= 0
    assert health, "the /healthz request's access line carries the id the server gave it"
    # every line the server logged since startup is one JSON object
    text = server.log.read_text()
    assert all(ln.startswith("{") for ln in text.splitlines() if ln.strip())


@pytest.mark.parametrize(
    "access, keys, status",
    [("off", None, 404), ("api_key", None, 200), ("api_key", "k1", 401), ("open", "k1", 200)],
)
def test_metrics_access_setting(access, keys, status):
    """`/metrics` per RECUR_METRICS_ACCESS, served by uvicorn over real HTTP (the route
    needs neither the model nor Redis, so the app runs without its lifespan)."""
    app = create_app(Settings(redis_url="redis://127.0.0.1:1/0", metrics_access=access, api_keys=keys))
    with serve_in_process(app) as url:
        r = httpx.get(f"{url}/metrics", timeout=10)
        assert r.status_code == status, r.text
        if status != 200:
            assert r.json()["error"]["type"] == {404: "not_found", 401: "unauthorized"}[status]
        else:
            assert "recur_generation_tokens_total" in r.text
        if keys:
            ok = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {keys}"})
            assert ok.status_code == 200
