"""Many streams at the price of few (issue 30): every figure of its targets, in one run.

Model level (1 torch thread, eager steps, each batch's step timed in turn, several
rounds, the best round's median kept, so that a burst of load on the shared machine
moves every batch alike):
  1. tokens/s of a 16-row and a 64-row decode step ÷ a 1-row step, shipped `shakespeare`;
     16 ÷ 1 for shipped `shakespeare-rlt`;
  2. the batch-64 step of `shakespeare` as a fraction of the 1-thread GEMM rate measured
     here; batch-1 steps of Transformer-XL 6 × 512 (mem 512) and 6 × 256 at attention
     length 3,800 as a fraction of the 1-thread read bandwidth measured here (the bytes
     and FLOPs a step must move and do are bench/roofline.py's `work`);
  3. `shakespeare-rlt` prefill tokens/s at 8k ÷ at 2k (`lm.consume`, best of 2).
Over HTTP (a `recur serve` process, Redis, 1 torch thread, compile off, default settings
otherwise):
  4. aggregate tokens/s of 16 streams ÷ 1 stream, with TTFT and ITL p50/p90/p99 at 1, 16
     and 64 streams (bench/serving.py's streams: 64 tokens each, temperature 0.8);
  5. p99 inter-token latency of 15 decoding streams while an 8,000-token prompt arrives
     (a `score`) ÷ their p99 without it (chunked prefill, `prefill_tokens_per_step`);
  6. a 5,000-token `score` on `shakespeare-rlt` over HTTP: tokens/s ÷ the model-level
     prefill tokens/s of the same prompt measured here.

`--write` puts the section into docs/BENCHMARKS.md (harness.write_section).
Usage: python bench/streams.py [--write] [--only model,http]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch
from harness import ROOT, Redis, Server, emit, model_dir, write_section
from roofline import MODELS, fill_length, gemm_rate, read_bandwidth, step, work
from serving import corpus_text, pct, stream

HEADING = "## 12. Many streams"
TARGETS = {
    "txl_16": 8.0,
    "txl_64": 16.0,
    "rlt_16": 6.0,
    "gemm_64": 0.5,
    "bw_6x512": 0.5,
    "bw_3800": 0.5,
    "http_16": 8.0,
    "rlt_8k_2k": 0.8,
    "rlt_http_score": 0.7,
    "stall_p99": 2.0,  # at most
}


# -- model level ----------------------------------------------------------------------------
@torch.no_grad()
def step_times(name: str, batches: list[int], rounds: int, steps: int) -> dict[int, float]:
    """Seconds per eager decode step at each batch: per round, `steps` steps of each batch
    in turn; the best round's median."""
    lm = MODELS[name]()
    n = fill_length(lm)
    one = lm.consume(
        torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(0)), lm.new_state(1)
    )[1]
    states = {B: lm.stack_states([one] * B) for B in batches}
    best = {B: float("inf") for B in batches}
    for _ in range(rounds):
        for B in batches:
            ids = torch.zeros(B, 1, dtype=torch.long)
            s = step(lm, states[B], ids)
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                s = step(lm, s, ids)
                times.append(time.perf_counter() - t0)
            states[B] = s
            best[B] = min(best[B], statistics.median(times))
    print(f"{name}: " + ", ".join(f"{B} rows {t * 1e3:.3f} ms" for B, t in best.items()), flush=True)
    return best


@torch.no_grad()
def roofline_fraction(name: str, B: int, limit: float, kind: str, rounds: int) -> dict:
    """A step's bytes/time ÷ the read bandwidth (kind "bandwidth") or FLOPs/time ÷ the GEMM
    rate ("gemm")."""
    lm = MODELS[name]()
    n = fill_length(lm)
    one = lm.consume(
        torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(0)), lm.new_state(1)
    )[1]
    state = lm.stack_states([one] * B)
    w = work(lm, state)
    t = step_times_on(lm, state, rounds)
    amount = w.bytes if kind == "bandwidth" else w.flops
    frac = amount / t / limit
    print(f"{name} batch {B}: {t * 1e3:.3f} ms, {frac:.1%} of the {kind} limit", flush=True)
    return {"model": name, "batch": B, "step_ms": round(t * 1e3, 3), "mb": round(w.bytes / 1e6, 2),
            "mflop": round(w.flops / 1e6, 1), "fraction": round(frac, 3)}  # fmt: skip


def step_times_on(lm, state, rounds: int, steps: int = 10) -> float:
    ids = torch.zeros(state.batch_size, 1, dtype=torch.long)
    state = step(lm, state, ids)
    best = float("inf")
    for _ in range(rounds):
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            state = step(lm, state, ids)
            times.append(time.perf_counter() - t0)
        best = min(best, statistics.median(times))
    return best


@torch.no_grad()
def prefill_rate(name: str, lengths: list[int]) -> dict[int, float]:
    """Tokens/s of `lm.consume` from an empty state, best of 2, per prompt length."""
    lm = MODELS[name]()
    text = corpus_text(max(lengths))
    ids = torch.tensor(lm.tokenizer.encode(text)[: max(lengths)])
    lm.consume(ids[: lm.segment_len], lm.new_state(1))  # warm-up
    out = {}
    for n in lengths:
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            lm.consume(ids[:n], lm.new_state(1))
            best = min(best, time.perf_counter() - t0)
        out[n] = n / best
    print(f"{name} prefill: " + ", ".join(f"{n} tokens {r:.0f} tok/s" for n, r in out.items()), flush=True)
    return out


def model_level(rounds: int) -> dict:
    torch.set_num_threads(1)
    bw, gemm = read_bandwidth(1), gemm_rate(1)
    print(f"1 thread: read {bw / 1e9:.1f} GB/s, GEMM {gemm / 1e9:.1f} GFLOP/s", flush=True)
    txl = step_times("shakespeare", [1, 16, 64], rounds, 10)
    rlt = step_times("shakespeare-rlt", [1, 16], rounds, 10)
    rlt_prefill = prefill_rate("shakespeare-rlt", [2048, 8192])
    return {
        "read_gbs": round(bw / 1e9, 2),
        "gemm_gflops": round(gemm / 1e9, 2),
        "txl_ms": {B: round(t * 1e3, 3) for B, t in txl.items()},
        "rlt_ms": {B: round(t * 1e3, 3) for B, t in rlt.items()},
        "txl_16": round(16 * txl[1] / txl[16], 2),
        "txl_64": round(64 * txl[1] / txl[64], 2),
        "rlt_16": round(16 * rlt[1] / rlt[16], 2),
        "gemm_64": roofline_fraction("shakespeare", 64, gemm, "gemm", rounds),
        "bw_6x512": roofline_fraction("txl-6x512-mem512", 1, bw, "bandwidth", rounds),
        "bw_3800": roofline_fraction("txl-6x256-len3800", 1, bw, "bandwidth", rounds),
        "rlt_prefill": {n: round(r, 1) for n, r in rlt_prefill.items()},
        "rlt_8k_2k": round(rlt_prefill[8192] / rlt_prefill[2048], 3),
    }


# -- over HTTP ------------------------------------------------------------------------------
async def sessions(client: httpx.AsyncClient, n: int) -> list[str]:
    return [(await client.post("/v1/sessions", json={"prompt": "ROMEO:"})).json()["id"] for _ in range(n)]


async def levels(client: httpx.AsyncClient, counts: list[int]) -> list[dict]:
    out = []
    for n in counts:
        sids = await sessions(client, n)
        await stream(client, sids[0], seed=0)  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*(stream(client, sid, seed=i) for i, sid in enumerate(sids)))
        wall = time.perf_counter() - t0
        ttft, itl = [r[0] for r in results], [g for r in results for g in r[1]]
        row = {"streams": n, "tokens_per_s": round(sum(r[2] for r in results) / wall, 1)}
        for q in (50, 90, 99):
            row[f"ttft_p{q}_ms"] = round(pct(ttft, q) * 1e3, 1)
        for q in (50, 90, 99):
            row[f"itl_p{q}_ms"] = round(pct(itl, q) * 1e3, 2)
        print(row, flush=True)
        out.append(row)
    return out


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
    model, _ = model_dir(name)
    redis = Redis(work_dir / "redis")
    server = Server(model, redis.url, work_dir / name, root=root, max_batch_size=64, cpu_threads=1,
                    compile=False, max_prompt_tokens=16384)  # fmt: skip
    try:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)

        async def go():
            async with httpx.AsyncClient(base_url=server.url, timeout=600, limits=limits) as client:
                return await fn(client)

        return asyncio.run(go())
    finally:
        server.stop()
        redis.stop()


def http_level(reps: int, root: Path) -> dict:
    work_dir = Path(tempfile.mkdtemp(prefix="recur-streams-"))

    async def txl(client):
        return {"levels": await levels(client, [1, 16, 64]), "stall": await stall(client, 8000, reps)}

    out = serve("shakespeare", work_dir, txl, root)
    one, sixteen = out["levels"][0], out["levels"][1]
    out["http_16"] = round(sixteen["tokens_per_s"] / one["tokens_per_s"], 2)
    out["stall_p99"] = out["stall"]["stall_p99"]
    text = corpus_text(5000)  # 5,000 characters: byte tokens, 5,000 tokens

    async def rlt(client):
        await score_rate(client, text[:500])  # warm-up
        return min([await score_rate(client, text) for _ in range(reps)])

    seconds = serve("shakespeare-rlt", work_dir, rlt, root)
    torch.set_num_threads(1)
    model_rate = prefill_rate("shakespeare-rlt", [5000])[5000]
    out["rlt_score"] = {
        "http_tokens_per_s": round(5000 / seconds, 1),
        "model_tokens_per_s": round(model_rate, 1),
    }
    out["rlt_http_score"] = round(5000 / seconds / model_rate, 3)
    print(out["rlt_score"], flush=True)
    return out


# -- the page -------------------------------------------------------------------------------
ROWS = [  # key, figure, issue 30's "today"
    ("txl_16", "shipped `shakespeare`, tokens/s of a 16-row decode step ÷ a 1-row step", "3.3×"),
    ("txl_64", "shipped `shakespeare`, 64 rows ÷ 1 row", "4.7×"),
    ("rlt_16", "shipped `shakespeare-rlt`, 16 rows ÷ 1 row", "2.2×"),
    ("gemm_64", "batch-64 decode, shipped `shakespeare`, fraction of the measured GEMM rate", "25%"),
    ("bw_6x512", "batch-1 decode, Transformer-XL 6 × 512 mem 512, bandwidth roofline", "40%"),
    ("bw_3800", "batch-1 decode, attention length 3,800, bandwidth roofline", "37%"),
    ("http_16", "aggregate tokens/s over HTTP/SSE, 16 streams ÷ 1 stream", "2.2×"),
    ("rlt_8k_2k", "shipped `shakespeare-rlt`, prefill tokens/s at 8k ÷ at 2k (model level)", "not measured"),
    (
        "rlt_http_score",
        "shipped `shakespeare-rlt`, 5,000-token `score` over HTTP ÷ model-level prefill",
        "0.2–0.6",
    ),
    ("stall_p99", "p99 ITL of 15 streams while an 8,000-token prompt arrives ÷ without", "not measured"),
]
FRACTIONS = {"gemm_64", "bw_6x512", "bw_3800"}


def verdict(key: str, value: float) -> tuple[str, str]:
    """(the figure as written, met / missed by how much)."""
    target = TARGETS[key]
    shown = f"{value:.0%}" if key in FRACTIONS else f"{value:.2f}" + ("" if key.startswith("rlt_") else "×")
    if key == "stall_p99":
        return shown, "met" if value <= target else f"**missed** ({value / target:.1f}× over)"
    return shown, "met" if value >= target else f"**missed** ({target / value:.1f}× short)"


def figures(result: dict) -> dict[str, float]:
    m, h = result.get("model", {}), result.get("http", {})
    out = {k: m[k] for k in ("txl_16", "txl_64", "rlt_16", "rlt_8k_2k") if k in m}
    out.update({k: m[k]["fraction"] for k in FRACTIONS if k in m})
    out.update({k: h[k] for k in ("http_16", "rlt_http_score", "stall_p99") if k in h})
    return out


def section(result: dict) -> str:
    lines = [HEADING, "", "Written by `python bench/streams.py --write` (`make bench`); every figure from one run. "
             "Model level: 1 torch thread, eager steps, each batch's step timed in turn over several rounds "
             "(the best round's median). Over HTTP: `recur serve`, 1 torch thread, compile off. "
             f"The machine's load average (1 minute) was {result.get('load_before')} at the start and "
             f"{result.get('load_after')} at the end: on 2 cores, a load above 2 means other jobs took "
             "cores from these figures, and every figure here is then noise-bound.", ""]  # fmt: skip
    m = result.get("model", {})
    if m:
        lines += [f"Limits measured in this run (1 thread): read {m['read_gbs']} GB/s, GEMM {m['gemm_gflops']} "
                  f"GFLOP/s. Steps (ms): `shakespeare` {m['txl_ms']}, `shakespeare-rlt` {m['rlt_ms']}; "
                  f"`shakespeare-rlt` prefill tokens/s {m['rlt_prefill']}.", ""]  # fmt: skip
    lines += ["| figure | before (issue 30) | target | measured | |", "|---|---|---|---|---|"]
    got = figures(result)
    for key, label, before in ROWS:
        t = TARGETS[key]
        target = ("≤ " if key == "stall_p99" else "≥ ") + (f"{t:.0%}" if key in FRACTIONS else f"{t:g}")
        shown, v = verdict(key, got[key]) if key in got else ("not measured", "")
        lines.append(f"| {label} | {before} | {target} | {shown} | {v} |")
    lines.append("| decode step vs HF TransfoXL 4.37.2 (6 × 512, mem 512) | 5–9× / 17–25× | ≥ 10× / ≥ 25× "
                 "| not measured by this script | |")  # fmt: skip
    h = result.get("http", {})
    if h:
        cols = list(h["levels"][0])
        lines += ["", "TTFT and ITL over HTTP/SSE (64 tokens per stream):", "",
                  "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]  # fmt: skip
        lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in h["levels"]]
        s = h["stall"]
        lines += ["", f"While an 8,000-token prompt arrives, the 15 streams' p99 ITL is {s['p99_during_ms']} ms "
                  f"against {s['p99_alone_ms']} ms without it (`prefill_tokens_per_step` 32: the prompt is "
                  f"consumed 32 tokens per step while they decode). RLT's 5,000-token score: "
                  f"{h['rlt_score']['http_tokens_per_s']} tokens/s over HTTP, "
                  f"{h['rlt_score']['model_tokens_per_s']} at the model level."]  # fmt: skip
    return "\n".join(lines) + "\n\n" + WHY + "\n"


WHY = """**Why the misses, and what would close them.** A decode step's attention now reads each \
cached key and value once, as two batched matrix-vector products over (rows × heads) on a \
time-major cache laid out layer by layer (`model.transformer_xl.attend_one`), the position \
term as the scores' starting value: side by side with the fused `sdpa` it replaced, 1.0–1.2× \
at `shakespeare`'s 16 and 64 rows and 1.15–1.2× on Transformer-XL 6 × 512. That is far short \
of the batched targets because the step is not bound by the attention alone: at 64 rows \
`shakespeare` also runs ~190 small ops per step (norms, biases, masks, the arena's row \
writes), whose overhead grows with the rows, and each (row, head) matrix-vector product \
is a separate BLAS call of a few microseconds. What would close it: one kernel per layer \
for the whole (rows × heads) attention (a small C++/OpenMP extension, or an inductor \
kernel for fixed shapes: bucketed batch sizes and attention lengths so the compiled step \
is one graph per bucket, which the probe currently rejects from 16 rows on), and fused \
projections. RLT's batched step is still the fused `sdpa` over its window and memory \
groups (not rewritten in this round). The HTTP ratio is bounded by the model-level ratio \
and by per-token work on the event loop (SSE framing) sharing the two cores."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="model,http")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--write", action="store_true")
    ap.add_argument(
        "--root", type=Path, default=ROOT, help="the source tree the server runs (a before/after)"
    )
    args = ap.parse_args()
    which = set(args.only.split(","))
    result: dict = {"load_before": round(os.getloadavg()[0], 1)}
    if "model" in which:
        result["model"] = model_level(args.rounds)
    if "http" in which:
        result["http"] = http_level(args.reps, args.root)
    result["load_after"] = round(os.getloadavg()[0], 1)
    for key, value in figures(result).items():
        print(f"{key}: {verdict(key, value)}", flush=True)
    if args.write:
        write_section(HEADING, section(result))
    emit(result)


if __name__ == "__main__":
    main()
