"""Persistence cost per request: state bytes and milliseconds read and written, for a
64-token generate on a session with full memory, with and without delta writes and the
hot state cache, against a real Redis. Read = Redis round trip + turning bytes into a
state; write = turning the state into bytes + the fenced commit.

In-process (engine + store, no HTTP), so the split between model time and persistence
time is exact. Every configuration runs in this one process, side by side.
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

import model
from app.engine import Engine
from app.store import SessionStore, StateBlobs
from model.sampling import SamplingParams

CONFIGS = [
    ("full state, no cache", dict(delta_persistence=False, hot_cache_bytes=0)),
    ("delta writes, no cache", dict(delta_persistence=True, hot_cache_bytes=0)),
    ("full state, hot cache", dict(delta_persistence=False, hot_cache_bytes=2**30)),
    ("delta writes + hot cache", dict(delta_persistence=True, hot_cache_bytes=2**30)),
]


async def run_config(lm, url: str, name: str, kw: dict, history: int, requests: int, tokens: int) -> dict:
    engine = Engine(lm, name="bench", cpu_threads=0, **kw)
    store = SessionStore(url, key_prefix=f"bench-{secrets.token_hex(4)}:")
    engine.start()
    consumed = await engine.new_session(list(b"x" * (history - 1)))
    meta = await store.create(
        StateBlobs(consumed.commit.snapshot), consumed.n_tokens, "bench", lm.fingerprint, 600
    )
    engine.remember(meta, consumed.commit)
    rows = []
    for i in range(requests + 1):
        base = dict(engine.timings)
        t0 = time.perf_counter()
        held = engine.held(meta.id)
        w = await store.begin(meta.id, None, held.commit_id if held else None)
        t_read = time.perf_counter() - t0
        gen = engine.generate(
            engine.source(w.meta, w.state, held),
            [],
            SamplingParams(0.0),
            seed=None,
            max_tokens=tokens,
            stop=[],
        )
        async for _ in gen:
            pass
        c = gen.result.commit
        t1 = time.perf_counter()
        meta = await w.commit(c.n_tokens, snapshot=c.snapshot, delta=c.delta)
        t_write = time.perf_counter() - t1
        engine.remember(meta, c)
        total = time.perf_counter() - t0
        load = engine.timings["load_s"] - base["load_s"]
        ser = engine.timings["serialise_s"] - base["serialise_s"]
        if i:  # the first request warms up
            rows.append(
                dict(
                    read_bytes=w.state.nbytes if w.state else 0,
                    write_bytes=c.nbytes,
                    read_ms=(t_read + load) * 1e3,
                    write_ms=(t_write + ser) * 1e3,
                    total_ms=total * 1e3,
                )
            )
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
