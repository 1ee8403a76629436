"""Another key's first token beside a flood of full-size state loads (issue 39, item 4),
measured side by side in one run.

The shipped assistant (`--model smollm2`) keeps up to sinks + window positions of keys and
values per session: a full state is about 47 MB. `--loaders` clients of a loading key load
full states in a loop, one of two ways (`--flood`):

  * `imports` (the default, the issue's attack, at the server's default settings): each
    client imports a full state (`POST /v1/sessions/import`: 47 MB read from the client,
    parsed and verified on the engine's loader thread, written to Redis), then deletes it;
  * `loads`: with the hot cache off (`--hot-cache-mb 0`, so every request loads its state
    from Redis, as a replica that did not serve the session last does), each client
    generates one token at a time on a full session of its own: 47 MB read from Redis,
    parsed and verified, the caches rebuilt (the engine thread), one step, a commit.

Each loader is a process of its own at nice `--client-nice` (19): a victim does not share an
interpreter with its attackers, and the attackers' own CPU (about 0.1 s per 47 MB upload)
stands for other machines', not this server's. `--client-nice 0` puts them on an equal
footing with the server and Redis on this machine's cores.

A victim key generates `TOKENS` tokens at a time on a short session of its own; its time to
first token is taken alone, beside the flood, and alone again once the flood has settled
(`SETTLE` seconds: the machine's load drifts), 100 generations a phase by default (so that a
p99 is not simply the worst one), and the ratio of p99s is printed with the loads' rate, the bytes they moved and the
machine's memory bandwidth measured in the same run.

Usage: python bench/state_loads.py [--flood imports|loads] [--loaders 3] [--requests 100]
                                   [--client-nice 19] [--set NAME=VALUE]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch
from harness import Redis, Server, emit

from model.corpus import load_split

LOADER, VICTIM = "bench-loading-key", "bench-victim-key"
TOKENS = 8
SETTLE = 5.0  # seconds between the flood's end and the quiet phase after it
HISTORY = 1100  # tokens of each loader's session: past sinks + window (4 + 1024), a full state


def memory_gbps() -> float:
    """This machine's copy bandwidth, one thread, read + write bytes (a 256 MB clone)."""
    torch.set_num_threads(1)
    x = torch.empty(64 * 2**20, dtype=torch.float32).fill_(1.0)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        x.clone()
        best = min(best, time.perf_counter() - t0)
    return 2 * x.nbytes / best / 1e9


def ttfts(url: str, sid: str, n: int) -> tuple[list[float], list]:
    """`n` streamed generations of TOKENS tokens on the victim's session: each one's first-token
    seconds, and the errors."""
    first, errors = [], []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {VICTIM}"}, timeout=120) as c:
        for _ in range(n):
            body = {"max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
            t0 = time.perf_counter()
            with c.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as r:
                if r.status_code != 200:
                    errors.append(r.status_code)
                    r.read()
                    continue
                seen = None
                for line in r.iter_lines():
                    if line.startswith("event: token") and seen is None:
                        seen = time.perf_counter() - t0
                first.append(seen or float("nan"))
            time.sleep(0.05)
    return first, errors


def p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[98] if len(xs) > 1 else xs[0]


class Flood:
    """One process per loader (a victim does not share an interpreter, and its lock, with
    the clients that flood the server): each imports the state at `blob` (a file) and
    deletes it, or generates one token on a session of its own (`sessions`), in a loop."""

    def __init__(self, url: str, sessions: list[str], blob: Path | None, niceness: int):
        ctx = mp.get_context("spawn")
        self.stop, self._loads, self._codes = ctx.Event(), ctx.Value("i", 0), ctx.Array("i", 600)
        self.errors: list[int] = []
        self.procs = [
            ctx.Process(target=_load, args=(url, s, blob, niceness, self.stop, self._loads, self._codes), daemon=True)
            for s in sessions
        ]
        for p in self.procs:
            p.start()

    @property
    def loads(self) -> int:
        return self._loads.value

    def close(self) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(timeout=300)
        self.errors = [code for code, n in enumerate(self._codes) for _ in range(n)]


def _load(url: str, sid: str, path: Path | None, niceness: int, stop, loads, codes) -> None:
    """One loader's loop (`Flood`), in a process of its own, at nice `niceness`."""
    os.nice(niceness)
    blob = path.read_bytes() if path is not None else None
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {LOADER}"}, timeout=300) as c:
        while not stop.is_set():
            if blob is not None:
                r = c.post("/v1/sessions/import", content=blob, headers={"Content-Type": "application/octet-stream"})
                if r.status_code < 300:
                    c.delete(f"/v1/sessions/{r.json()['id']}")
            else:
                r = c.post(f"/v1/sessions/{sid}/generate", json={"max_tokens": 1, "stream": False})
            if r.status_code < 300:
                with loads.get_lock():
                    loads.value += 1
            else:
                with codes.get_lock():
                    codes[min(r.status_code, 599)] += 1
                time.sleep(0.05)  # (a 429 says when to retry; the flood retries sooner)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--flood", choices=("imports", "loads"), default="imports")
    ap.add_argument("--loaders", type=int, default=3, help="the loading key's clients (the issue's: 3)")
    ap.add_argument("--requests", type=int, default=100, help="the victim's generations per phase")
    ap.add_argument("--client-nice", type=int, default=19, help="the loaders' niceness (0: the server's)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a server setting")
    args = ap.parse_args()
    extra = dict(item.split("=", 1) for item in args.set)
    work = Path(tempfile.mkdtemp(prefix="recur-loads-"))
    (work / "keys").write_text(f"{LOADER}\n{VICTIM}\n")
    redis = Redis(work / "redis")
    settings = {"api_keys_file": work / "keys", **({"hot_cache_mb": 0} if args.flood == "loads" else {}), **extra}
    server = Server(args.model, redis.url, work / "server", **settings)
    text = load_split("shakespeare", "valid")[0][1][: HISTORY * 8]  # (~4 characters a token)
    try:
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {LOADER}"}, timeout=600) as c:
            first = c.post("/v1/sessions", json={"prompt": text}).json()
            assert first["n_tokens"] >= HISTORY, first
            full = c.get(f"/v1/sessions/{first['id']}/state")
            state_bytes = len(full.content)
            sessions = [first["id"]] + [
                c.post(f"/v1/sessions/{first['id']}/fork").json()["id"] for _ in range(args.loaders - 1)
            ]
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {VICTIM}"}, timeout=60) as c:
            victim = c.post("/v1/sessions", json={"prompt": "ROMEO:\n"}).json()["id"]
        ttfts(server.url, victim, 3)  # (warm)
        alone, e0 = ttfts(server.url, victim, args.requests)
        (work / "state").write_bytes(full.content)
        flood = Flood(server.url, sessions, work / "state" if args.flood == "imports" else None, args.client_nice)
        time.sleep(2)
        began, loads0 = time.perf_counter(), flood.loads
        beside, e1 = ttfts(server.url, victim, args.requests)
        seconds, loads = time.perf_counter() - began, flood.loads - loads0
        flood.close()
        time.sleep(SETTLE)  # (the flood's last imports' deletes and frees: not the quiet phase's)
        after, e2 = ttfts(server.url, victim, args.requests)
    finally:
        server.stop()
        redis.stop()
    gbps = memory_gbps()
    base = (p99(alone) + p99(after)) / 2
    rows = [("alone", alone, e0), (f"beside {args.loaders} loaders", beside, e1), ("alone, after", after, e2)]
    print(f"# another key's first token beside {args.loaders} clients' full-state {args.flood}: "
          f"`{args.model}`, loaders at nice {args.client_nice} {' '.join(args.set)}")  # fmt: skip
    print(f"a full state: {state_bytes / 1e6:.1f} MB; loads beside the victim: {loads} in {seconds:.1f} s "
          f"({loads / seconds:.2f}/s, {loads * state_bytes / seconds / 1e6:.0f} MB/s read from Redis); "
          f"this machine copies {gbps:.1f} GB/s (one thread)")  # fmt: skip
    print("| victim's phase | TTFT p50 | TTFT p99 | errors | p99 ÷ alone |\n|---|---|---|---|---|")
    for name, xs, errors in rows:
        print(f"| {name} | {statistics.median(xs) * 1000:.0f} ms | {p99(xs) * 1000:.0f} ms | {len(errors)} "
              f"| {p99(xs) / base:.2f}x |")  # fmt: skip
    print(f"loader errors: {sorted(set(flood.errors))} ({len(flood.errors)})")
    emit({
        "state_bytes": state_bytes, "loads": loads, "seconds": seconds, "memory_gbps": gbps,
        "ttft_alone_s": alone, "ttft_beside_s": beside, "ttft_after_s": after,
        "errors": [e0, e1, e2, flood.errors],
    })  # fmt: skip


if __name__ == "__main__":
    main()
