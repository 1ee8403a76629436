"""Section 12 over HTTP (bench/streams.py): a `recur serve` process with Redis (1 torch thread,
compile off): tokens/s, TTFT and ITL at 1, 16 and 64 streams, the p99 ITL of 15 streams while an
8,000-token prompt arrives, and a 5,000-token RLT `score` over HTTP against the same prompt
through an in-process `Engine` and through `lm.consume` (`score_gap`).

Measures only: it writes no page (bench/streams.py renders what `http_level` returns).
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import httpx
import torch
from harness import Redis, Server, model_dir
from serving import corpus_text, cpu_seconds, levels, pct, sessions, stream

import model


async def stall(client: httpx.AsyncClient, prompt_tokens: int, reps: int) -> dict:
    """p99 ITL of 15 streams alone, and while a `prompt_tokens` score arrives (best of reps
    each: noise only adds time)."""
    sids = await sessions(client, 16)
    text = corpus_text(prompt_tokens)

    async def run(with_prompt: bool) -> float:
        jobs = [stream(client, sid, seed=i) for i, sid in enumerate(sids[:15])]
        if with_prompt:

            async def late() -> None:
                await asyncio.sleep(0.02)  # the streams decode first
                r = await client.post(
                    f"/v1/sessions/{sids[15]}/score", json={"prompt": text, "commit": False}
                )
                r.raise_for_status()

            results = (await asyncio.gather(*jobs, late()))[:15]
        else:
            results = await asyncio.gather(*jobs)
        return pct([g for r in results for g in r[1]], 99)

    alone = min([await run(False) for _ in range(reps)])
    during = min([await run(True) for _ in range(reps)])
    row = {"p99_alone_ms": round(alone * 1e3, 2), "p99_during_ms": round(during * 1e3, 2),
           "stall_p99": round(during / alone, 2)}  # fmt: skip
    print(row, flush=True)
    return row


async def score_rate(client: httpx.AsyncClient, text: str) -> float:
    sid = (await sessions(client, 1))[0]
    t0 = time.perf_counter()
    r = await client.post(f"/v1/sessions/{sid}/score", json={"prompt": text, "commit": False})
    r.raise_for_status()
    return time.perf_counter() - t0


def serve(name: str, work_dir: Path, fn, root: Path):
    """`fn(client, server)` against a `recur serve` of `name` (1 torch thread, compile off)."""
    model, _ = model_dir(name)
    redis = Redis(work_dir / "redis")
    server = Server(model, redis.url, work_dir / name, root=root, max_batch_size=64, cpu_threads=1,
                    compile=False, max_prompt_tokens=16384)  # fmt: skip
    try:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)

        async def go():
            async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as client:
                return await fn(client, server)

        return asyncio.run(go())
    finally:
        server.stop()
        redis.stop()


async def in_process(run) -> tuple[float, float]:
    """(wall, CPU) seconds of `await run()` in this process."""
    w0, c0 = time.perf_counter(), time.process_time()
    await run()
    return time.perf_counter() - w0, time.process_time() - c0


async def score_gap(client: httpx.AsyncClient, server: Server, text: str, reps: int) -> dict:
    """A `score` of `text` three ways, in turn each round (best of `reps` rounds): over HTTP
    (wall; the server process's CPU), through an `Engine` in this process (no HTTP, no
    sessions, no Redis) and through `lm.consume` (wall; CPU)."""
    from app.assembly import build_engine
    from app.config import Settings
    from app.engine.requests import Request

    torch.set_num_threads(1)
    lm = model.load("shakespeare-rlt", device="cpu")
    ids = lm.tokenizer.encode(text)
    engine = build_engine(Settings(compile=False, cpu_threads=1), lm, "shakespeare-rlt")
    engine.start()

    async def http() -> tuple[float, float]:
        c0 = cpu_seconds(server.proc.pid)
        wall = await score_rate(client, text)
        return wall, cpu_seconds(server.proc.pid) - c0

    async def engine_score() -> None:
        async for _ in engine.submit(Request(None, list(ids), prompt_logprobs=True)):
            pass

    async def consume() -> None:
        lm.consume(ids, lm.new_state(1))

    try:
        await score_rate(client, text[:500])  # warm-ups
        await engine_score()
        ways = {"http": [], "engine": [], "model": []}
        for _ in range(reps):
            ways["http"].append(await http())
            ways["engine"].append(await in_process(engine_score))
            ways["model"].append(await in_process(consume))
    finally:
        engine.stop()
    out = {}
    for way, runs in ways.items():
        wall, cpu = min(runs)  # the fastest round's
        out[way] = {
            "tokens_per_s": round(len(ids) / wall, 1),
            "wall_s": round(wall, 3),
            "cpu_s": round(cpu, 3),
        }
    return {"tokens": len(ids), **out}


def http_level(reps: int, root: Path) -> dict:
    work_dir = Path(tempfile.mkdtemp(prefix="recur-streams-"))

    async def txl(client, server):
        return {
            "levels": await levels(client, [1, 16, 64], reps, server.proc.pid),
            "stall": await stall(client, 8000, reps),
        }

    out = serve("shakespeare", work_dir, txl, root)
    one, sixteen = out["levels"][0], out["levels"][1]
    out["http_16"] = round(sixteen["tokens_per_s"] / one["tokens_per_s"], 2)
    out["stall_p99"] = out["stall"]["stall_p99"]
    text = corpus_text(5000)  # 5,000 characters: byte tokens, 5,000 tokens

    async def rlt(client, server):
        return await score_gap(client, server, text, reps + 1)

    gap = out["rlt_score"] = serve("shakespeare-rlt", work_dir, rlt, root)
    out["rlt_http_score"] = round(gap["http"]["tokens_per_s"] / gap["model"]["tokens_per_s"], 3)
    print(gap, flush=True)
    return out
