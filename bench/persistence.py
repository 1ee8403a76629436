"""Persistence cost per request: state bytes and milliseconds read and written, for a
64-token generate on a session with full memory, with and without delta writes and the
hot state cache, against a real Redis. Read = Redis round trip + turning bytes into a
state; write = turning the state into bytes + the fenced commit.

In-process (the sessions service over its engine and store, no HTTP), so the split
between model time and persistence time is exact: the engine counts the seconds it spends
loading and encoding states, and the Redis round trips are timed around them. Every configuration runs in this one process, side by side.
Usage: python bench/persistence.py [--model NAME|DIR] [--requests 12]
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import tempfile
import time
from pathlib import Path

from harness import Redis, emit, model_dir
from prometheus_client import REGISTRY

import model
from app.assembly import build_engine, build_sessions, build_tenants
from app.config import Settings
from app.sessions import Generation
from app.store import Store
from model.sampling import SamplingParams

CONFIGS = [
    ("full state, no cache", dict(delta_persistence=False, hot_cache_mb=0)),
    ("delta writes, no cache", dict(delta_persistence=True, hot_cache_mb=0)),
    ("full state, hot cache", dict(delta_persistence=False, hot_cache_mb=1024)),
    ("delta writes + hot cache", dict(delta_persistence=True, hot_cache_mb=1024)),
]


def _bytes_read() -> float:
    return REGISTRY.get_sample_value("recur_state_bytes_read_total") or 0.0


async def run_config(lm, url: str, name: str, kw: dict, history: int, requests: int, tokens: int) -> dict:
    settings = Settings(redis_url=url, key_prefix=f"bench-{secrets.token_hex(4)}:", cpu_threads=0, **kw)
    engine = build_engine(settings, lm, "bench")
    store = Store.from_settings(settings)
    sessions = build_sessions(settings, store, engine, build_tenants(settings, store))
    engine.start()
    meta = await sessions.create(list(b"x" * (history - 1)), 600, "")
    rows = []
    for i in range(requests + 1):
        row = await _one_request(sessions, meta.id, tokens)
        if i:  # the first request warms up
            rows.append(row)
    engine.stop()
    await store.close()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    mean_bytes = {k: statistics.mean(r[k] for r in rows) for k in ("read_bytes", "write_bytes")}
    return {
        "config": name,
        "read_bytes": round(mean_bytes["read_bytes"]),
        "write_bytes": round(mean_bytes["write_bytes"]),
        "read_ms": round(med["read_ms"], 3),
        "write_ms": round(med["write_ms"], 3),
        "request_ms": round(med["total_ms"], 1),
        "persistence_share": round((med["read_ms"] + med["write_ms"]) / med["total_ms"], 4),
    }


async def _one_request(sessions, sid: str, tokens: int) -> dict:
    counters = sessions.engine.counters
    load0, read0 = counters.load_seconds, _bytes_read()
    t0 = time.perf_counter()
    run = await sessions.generate(sid, [], Generation(SamplingParams(0.0), tokens), expected=None, owner="")
    t_read = time.perf_counter() - t0  # the lock and the state, or the hot copy's confirmation
    seen = []
    try:
        async for _ in run.stream():
            seen.append(time.perf_counter())
    finally:
        await run.close()
    total = time.perf_counter() - t0
    # after the last token: one more decode step (the engine consumes that token), the
    # encoding, and the fenced commit; less the step (the median gap between tokens)
    step = (
        statistics.median(b - a for a, b in zip(seen[:-1], seen[1:], strict=True)) if len(seen) > 1 else 0.0
    )
    t_write = max(0.0, total - (seen[-1] - t0) - step)
    assert run.result.encoded is not None
    return dict(
        read_bytes=_bytes_read() - read0,
        write_bytes=len(run.result.encoded.blob),
        read_ms=(t_read + counters.load_seconds - load0) * 1e3,
        write_ms=t_write * 1e3,
        total_ms=total * 1e3,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="shakespeare")
    ap.add_argument("--history", type=int, default=2048)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    name, described = model_dir(args.model)
    lm = model.load(name, device="cpu")
    work = Path(tempfile.mkdtemp(prefix="recur-bench-"))
    redis = Redis(work / "redis")
    try:
        rows = []
        for cname, kw in CONFIGS:
            row = asyncio.run(run_config(lm, redis.url, cname, kw, args.history, args.requests, args.tokens))
            print(row, flush=True)
            rows.append(row)
    finally:
        redis.stop()
    emit({"model": described, "history": args.history, "tokens": args.tokens, "persistence": rows})


if __name__ == "__main__":
    main()
