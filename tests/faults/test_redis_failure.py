"""Redis failure: SIGKILL a durable Redis (AOF, appendfsync always) under load, restart it
on the same port and directory, and keep the same server process throughout.

- in-flight and new requests fail fast: 503 redis_unavailable (outcome_unknown for a write
  in flight), or an `error` event once a stream has begun; never a hang (every client
  wait is bounded, and each failure returns well inside that bound);
- /readyz goes 503, then back to 200 without restarting the server;
- no acknowledged commit is lost: every 200/`done` a client saw is in Redis afterwards.

And a full Redis (maxmemory reached, `noeviction`) refuses writes: 503 (or the storage
guard's 507), nothing changed.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import httpx
import redis

from .harness import error_type, store_for, stored, stream_generate

N_SESSIONS = 6
CLIENT_BOUND = 20.0  # seconds any client waits for anything; a hang would hit it
# greedy decoding of these random tiny models never samples EOS: the stream runs to its end
GREEDY_LONG = {"max_tokens": 1000, "temperature": 0}
REFUSED = {(503, "redis_unavailable"), (507, "storage_full")}


@dataclass
class Outcome:
    phase: str  # "before" | "outage" | "after": when the request started
    kind: str  # "ok", "http", "event", "transport"
    status: int
    error: str
    seconds: float


def test_a_full_redis_refuses_writes_with_503(durable_up, lm):
    red, srv = durable_up
    r = redis.Redis.from_url(red.url)
    try:
        with srv.client() as c:
            sid = c.post("/v1/sessions", json={"prompt": "full"}).json()["id"]
            assert (
                c.post(f"/v1/sessions/{sid}/score", json={"prompt": "!", "commit": True}).status_code == 200
            )
            r.config_set("maxmemory-policy", "noeviction")
            r.config_set("maxmemory", 1)  # every write is over the limit now
            try:
                for method, path, body in [
                    ("POST", "/v1/sessions", {"prompt": "new"}),
                    ("POST", f"/v1/sessions/{sid}/score", {"prompt": "x", "commit": True}),
                    ("POST", f"/v1/sessions/{sid}/generate", {"max_tokens": 2, "stream": False}),
                    ("POST", f"/v1/sessions/{sid}/generate", {"max_tokens": 2}),
                    ("POST", f"/v1/sessions/{sid}/fork", None),
                ]:
                    # Redis's own refusal (503), or the storage guard's (507) once its
                    # reading (every half second) has seen the full Redis: nothing written
                    resp = c.request(method, path, json=body)
                    refusal = (resp.status_code, error_type(resp))
                    assert refusal in REFUSED, (path, resp.status_code, resp.text)
            finally:
                r.config_set("maxmemory", 0)
            # the guard lets writes in again at its next reading
            deadline = time.monotonic() + CLIENT_BOUND
            while c.get("/readyz").json().get("storage_full") and time.monotonic() < deadline:
                time.sleep(0.1)
            s = stored(r, store_for(srv), sid, lm)
            assert (s.version, s.n_tokens) == (1, 1 + len("full!"))
            resp = c.post(f"/v1/sessions/{sid}/score", json={"prompt": "?", "commit": True})
            assert resp.status_code == 200 and resp.json()["session"]["version"] == 2
    finally:
        r.close()


def test_redis_killed_under_load(durable_up, lm):
    red, srv = durable_up
    pid = srv.proc.pid if srv.proc else None
    keys = store_for(srv)
    phase = "before"
    stop = threading.Event()
    lock = threading.Lock()
    outcomes: list[Outcome] = []
    acked: dict[str, list[tuple[int, int]]] = {}
    readyz: list[int] = []
    try:
        with srv.client() as c:
            for i in range(N_SESSIONS):
                resp = c.post("/v1/sessions", json={"prompt": f"s{i}"})
                assert resp.status_code == 201, resp.text
                d = resp.json()
                acked[d["id"]] = [(d["version"], d["n_tokens"])]
        sids = list(acked)

        def record(sid: str, out: Outcome, version: int = -1, n_tokens: int = -1) -> None:
            with lock:
                outcomes.append(out)
                if out.kind == "ok":
                    acked[sid].append((version, n_tokens))

        def client_loop(i: int, sid: str) -> None:
            rng = random.Random(i)
            with httpx.Client(base_url=srv.url, timeout=CLIENT_BOUND) as c:
                last_ok = False
                while not (stop.is_set() and last_ok):  # each client ends on a success
                    started = phase
                    t0 = time.monotonic()
                    if rng.random() < 0.5:
                        prompt = list(rng.randbytes(rng.randint(1, 12)))
                        try:
                            r = c.post(f"/v1/sessions/{sid}/score", json={"prompt": prompt, "commit": True})
                        except httpx.TransportError as exc:
                            record(sid, Outcome(started, "transport", 0, type(exc).__name__, 0))
                            return
                        dt = time.monotonic() - t0
                        if r.status_code == 200:
                            s = r.json()["session"]
                            record(sid, Outcome(started, "ok", 200, "", dt), s["version"], s["n_tokens"])
                        else:
                            record(sid, Outcome(started, "http", r.status_code, error_type(r), dt))
                        last_ok = r.status_code == 200
                    else:
                        body = {
                            "max_tokens": rng.randint(2, 40),
                            "temperature": 1.0,
                            "seed": rng.randint(0, 99),
                        }
                        o = stream_generate(c, sid, body)
                        kind = {"done": "ok", "error": "event"}.get(o.kind, o.kind)
                        record(
                            sid, Outcome(started, kind, o.status, o.error, o.seconds), o.version, o.n_tokens
                        )
                        if o.kind == "transport":
                            return
                        last_ok = o.kind == "done"
                    time.sleep(0.005)

        # one long stream is mid-flight when Redis dies: it must end in an `error` event
        long_started = threading.Event()
        long_result: list = []
        with httpx.Client(base_url=srv.url, timeout=CLIENT_BOUND) as c:
            long_sid = c.post("/v1/sessions").json()["id"]

        def long_stream() -> None:
            with httpx.Client(base_url=srv.url, timeout=CLIENT_BOUND) as c:
                long_result.append(stream_generate(c, long_sid, GREEDY_LONG, on_token=long_started))

        threads = [threading.Thread(target=client_loop, args=(i, s)) for i, s in enumerate(sids)]
        threads.append(threading.Thread(target=long_stream))
        for t in threads:
            t.start()

        def wait_for(cond, what: str, limit: float = 60) -> None:
            end = time.monotonic() + limit
            while not cond():
                assert time.monotonic() < end, f"timed out waiting for {what}"
                time.sleep(0.01)

        def count(ph: str, kinds: tuple[str, ...]) -> int:
            with lock:
                return sum(o.phase == ph and o.kind in kinds for o in outcomes)

        wait_for(lambda: count("before", ("ok",)) >= 3 * N_SESSIONS and long_started.is_set(), "load")
        red.kill()  # SIGKILL, by PID
        phase = "outage"
        with srv.client() as hc:
            # every client sees the outage (each request started after the kill fails)
            wait_for(lambda: count("outage", ("http", "event")) >= 2 * N_SESSIONS, "failures")
            wait_for(lambda: bool(long_result), "the long stream to end")
            r = hc.get("/readyz", timeout=CLIENT_BOUND)
            readyz.append(r.status_code)
            assert r.status_code == 503 and error_type(r) == "redis_unavailable"
            assert hc.get("/healthz").status_code == 200
            red.start()  # same port, same directory: the AOF is replayed
            phase = "after"
            wait_for(lambda: hc.get("/readyz", timeout=CLIENT_BOUND).status_code == 200, "readyz 200")
            # the same process recovers: every client commits again
            wait_for(lambda: count("after", ("ok",)) >= 2 * N_SESSIONS, "recovery")
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads)
        assert srv.proc is not None and srv.proc.pid == pid and srv.proc.poll() is None
    finally:
        stop.set()

    # nothing but successes, fast Redis failures, and a stale lock's brief 409; a commit in
    # flight when Redis died may have reached its AOF first: its outcome is unknown
    allowed = {
        ("ok", 200, ""),
        ("http", 503, "redis_unavailable"),
        ("event", 200, "redis_unavailable"),
        ("http", 503, "outcome_unknown"),
        ("event", 200, "outcome_unknown"),
        ("http", 409, "session_busy"),
    }
    kinds = {(o.kind, o.status, o.error) for o in outcomes}
    assert kinds <= allowed, kinds - allowed
    failures = [o for o in outcomes if o.kind in ("http", "event") and o.status != 409]
    assert any(o.phase == "outage" for o in failures)
    assert not any(o.phase == "after" for o in failures)  # recovered: no 503 once Redis is back
    assert max(o.seconds for o in failures) < CLIENT_BOUND / 4  # fast, nowhere near the bound
    assert len(long_result) == 1 and long_result[0].kind == "error", long_result
    assert long_result[0].error == "redis_unavailable" and long_result[0].tokens > 0

    # no acknowledged commit is lost: Redis holds each session at its last acknowledged version
    red_client = redis.Redis.from_url(red.url)
    try:
        for sid, seen in acked.items():
            versions = [v for v, _ in seen]
            assert versions == sorted(set(versions))  # one client per session: strictly rising
            s = stored(red_client, keys, sid, lm)
            assert (s.version, s.n_tokens) == seen[-1], (sid, s.version, seen[-3:])
    finally:
        red_client.close()
