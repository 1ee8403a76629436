"""One tenant against another (issue 25), measured side by side in one run.

1. Fairness: a victim key's generations (32 tokens, greedy, one at a time) alone, then
   while an attacker key holds N streams that never read a byte (the issue's attack: 500
   streams), then while it runs 64 streams that read as fast as they come (a heavy but
   honest tenant). Printed: the victim's latency (median and worst) and time to first
   token in each phase, its errors, and each loaded phase's ratio to the unloaded one.
2. Imports: `/healthz` answered idle, then while 4 clients each send a 17 MB blob of 200k
   empty tensors (the issue's event-loop attack) in a loop. Printed: its median and worst
   answer times in both, and their ratio.

Usage: python bench/hostile.py [--model NAME|DIR] [--streams N] [--root DIR] [--set NAME=VALUE]
`--root` serves another source tree (a worktree of an older commit) with the same
settings, for the "before" column: e.g. `git worktree add /tmp/b8 b8a1bec`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from harness import ROOT, Redis, Server, emit, model_dir

ATTACKER, VICTIM = "bench-attacker-key", "bench-victim-key"
TOKENS = 32


def victim_latencies(url: str, n: int) -> dict:
    """`n` greedy generations of TOKENS tokens, one at a time, streamed: each one's total
    and first-token seconds, and the errors."""
    total, first, errors = [], [], []
    headers = {"Authorization": f"Bearer {VICTIM}"}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
        sid = c.post("/v1/sessions", json={"prompt": "ROMEO:\n"}).json()["id"]
        for _ in range(n):
            body = {"max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
            t0 = time.perf_counter()
            try:
                with c.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as r:
                    if r.status_code != 200:
                        errors.append(r.status_code)
                        r.read()
                        continue
                    seen = None
                    for line in r.iter_lines():
                        if line.startswith("event: token") and seen is None:
                            seen = time.perf_counter() - t0
                total.append(time.perf_counter() - t0)
                first.append(seen or 0.0)
            except httpx.HTTPError as exc:
                errors.append(type(exc).__name__)
    return {
        "latency_p50_s": statistics.median(total) if total else None,
        "latency_max_s": max(total) if total else None,
        "ttft_p50_s": statistics.median(first) if first else None,
        "errors": errors,
    }


def silent_flood(url: str, n: int) -> list[socket.socket]:
    """`n` streaming completions from the attacker whose client never reads."""
    u = urlsplit(url)
    out = []
    for i in range(n):
        body = json.dumps({"prompt": f"flood {i}", "max_tokens": 1000, "stream": True, "ignore_eos": True})
        sock = socket.create_connection((u.hostname, u.port), timeout=30)
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {u.netloc}\r\nAuthorization: Bearer {ATTACKER}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        out.append(sock)
    return out


class ReadingFlood:
    """`n` attacker streams that read as fast as they come, restarted as they end."""

    def __init__(self, url: str, n: int):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=asyncio.run, args=(self._run(url, n),), daemon=True)
        self.thread.start()

    async def _run(self, url: str, n: int) -> None:
        headers = {"Authorization": f"Bearer {ATTACKER}"}
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as c:

            async def one(i: int) -> None:
                while not self.stop.is_set():
                    body = {"prompt": f"busy {i}", "max_tokens": 200, "stream": True, "ignore_eos": True}
                    async with c.stream("POST", "/v1/completions", json=body) as r:
                        async for _ in r.aiter_lines():
                            if self.stop.is_set():
                                return

            await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=60)


def healthz_times(url: str, n: int) -> list[float]:
    out = []
    with httpx.Client(base_url=url, timeout=120) as c:
        for _ in range(n):
            t0 = time.perf_counter()
            c.get("/healthz")
            out.append(time.perf_counter() - t0)
            time.sleep(0.05)
    return out


def import_flood(url: str, stop: threading.Event) -> list[threading.Thread]:
    header = {f"t{i}": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]} for i in range(200_000)}
    header["__metadata__"] = {"recur": json.dumps({"format": 1})}
    raw = json.dumps(header).encode()
    blob = len(raw).to_bytes(8, "little") + raw

    def send() -> None:
        headers = {"Authorization": f"Bearer {ATTACKER}", "Content-Type": "application/octet-stream"}
        with httpx.Client(base_url=url, headers=headers, timeout=300) as c:
            while not stop.is_set():
                c.post("/v1/sessions/import", content=blob)

    threads = [threading.Thread(target=send, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    return threads


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def report(phases: dict, idle: list[float], loaded: list[float], described: str) -> None:
    """The victim's phases against its unloaded latency (taken before and after: the machine's
    load drifts), and /healthz idle and during hostile imports."""
    base = {
        k: statistics.mean(p[k] for p in (phases["alone"], phases["alone, after"]))
        for k in ("latency_p50_s", "ttft_p50_s")
    }
    print(f"# one tenant against another: {described}")
    print("| victim's phase | latency p50 | worst | TTFT p50 | errors | latency ÷ alone | TTFT ÷ alone |")
    print("|---|---|---|---|---|---|---|")
    for name, p in phases.items():
        lat, worst, ttft = p["latency_p50_s"], p["latency_max_s"], p["ttft_p50_s"]
        cells = [f"{x * 1000:.0f} ms" if x else "n/a" for x in (lat, worst, ttft)]
        print(
            f"| {name} | {' | '.join(cells)} | {len(p['errors'])} {sorted(set(map(str, p['errors'])))} "
            f"| {ratio(lat, base['latency_p50_s'])} | {ratio(ttft, base['ttft_p50_s'])} |"
        )
    print("\n| /healthz | p50 | worst |\n|---|---|---|")
    print(f"| idle | {statistics.median(idle) * 1000:.1f} ms | {max(idle) * 1000:.1f} ms |")
    print(
        f"| 4 clients importing 200k-tensor blobs | {statistics.median(loaded) * 1000:.1f} ms | {max(loaded) * 1000:.1f} ms |"
    )
    print(f"worst /healthz under imports ÷ idle p50: {max(loaded) / statistics.median(idle):.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="shakespeare")
    ap.add_argument("--streams", type=int, default=320, help="the attacker's streams that never read")
    ap.add_argument("--requests", type=int, default=12, help="the victim's generations per phase")
    ap.add_argument("--root", type=Path, default=ROOT, help="the source tree to serve")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a server setting")
    args = ap.parse_args()
    extra = dict(item.split("=", 1) for item in args.set)
    model, described = model_dir(args.model)
    work = Path(tempfile.mkdtemp(prefix="recur-hostile-"))
    (work / "keys").write_text(f"{ATTACKER}\n{VICTIM}\n")
    redis = Redis(work / "redis")
    server = Server(
        model, redis.url, work / "server", root=args.root, compile=False, cpu_threads=1,
        api_keys_file=work / "keys", max_import_mb=64, **extra,
    )  # fmt: skip
    try:
        phases = {"alone": victim_latencies(server.url, args.requests)}
        flood = silent_flood(server.url, args.streams)
        time.sleep(3)
        phases[f"{args.streams} silent streams"] = victim_latencies(server.url, args.requests)
        for sock in flood:
            sock.close()
        time.sleep(3)
        busy = ReadingFlood(server.url, 64)
        time.sleep(3)
        phases["64 reading streams"] = victim_latencies(server.url, args.requests)
        busy.close()
        time.sleep(3)
        # alone again: the machine's load drifts, so the unloaded figure is taken on both sides
        phases["alone, after"] = victim_latencies(server.url, args.requests)
        idle = healthz_times(server.url, 20)
        stop = threading.Event()
        senders = import_flood(server.url, stop)
        time.sleep(1)
        loaded = healthz_times(server.url, 20)
        stop.set()
        for t in senders:
            t.join(timeout=300)
    finally:
        server.stop()
        redis.stop()
    report(phases, idle, loaded, f"{described}, served from {args.root} {' '.join(args.set)}")
    emit({"phases": phases, "healthz_idle_s": idle, "healthz_importing_s": loaded, "root": str(args.root)})


if __name__ == "__main__":
    main()
