"""Soak: sustained load on two replicas sharing one Redis, watching errors, latency and the
replicas' resident memory. Not a test: run it by hand (it takes minutes), e.g.

    nice -n 10 .venv/bin/python bench/soak.py                  # 200 sessions x 10 requests
    nice -n 10 .venv/bin/python bench/soak.py --sessions 40    # a quick look

It starts a redis-server (AOF everysec) and `--replicas` servers itself, then drives
conversations of `--requests` requests each from `--clients` concurrent asyncio clients.
A conversation hops between replicas at random; its requests are a mix of streaming and
non-streaming generations and scores (committed or not). A few requests are deliberately
doubled, sent to both replicas at once: one of the pair must get 409 session_busy, the
only error besides 429 (queue full) that counts as intended.

The run has two phases, with the replicas left idle for `--settle` seconds after each:

1. warm-up: `--warmup-sessions` conversations of the same shape, enough to fill every
   replica's hot state cache (a session's state grows with its conversation, so the
   cache fills only once conversations have run a while) and to reach the largest
   batches; whether the caches were full is read from each replica's /metrics;
2. the load: `--sessions` conversations, on which errors and latency are reported.

Memory growth after warm-up compares each replica's resident memory idle after the load
with its memory idle after warm-up: at equal (no) load, so what it measures is memory the
load left behind, a leak. Under load, resident memory also holds the running batch's
working tensors, which rise and fall with the batch; that is plotted and reported (medians
of the load's two halves and the peak), but it follows the load, not the time.

It writes a PNG plot and a JSON summary, and exits non-zero if an unintended error
occurred or memory grew by 10% or more.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import ROOT, Redis, Server  # noqa: E402

INTENDED = {"409 session_busy", "429 queue_full"}
TEXT = (
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate. "
    "Rough winds do shake the darling buds of May, and summer's lease hath all too short a date."
).split(" ")


@dataclass
class Sample:
    t: float  # seconds since the load began
    kind: str
    outcome: str  # "ok" or "<status> <error type>"
    seconds: float
    ttft: float | None = None  # streaming: time to the first token
    phase: str = "load"  # or "warmup"


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    memory: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))
    # per replica, from its /metrics: (t, hot cache MiB, sessions in the running batch)
    engine: dict[str, list[tuple[float, float, float]]] = field(default_factory=lambda: defaultdict(list))
    idle_mib: dict[str, dict[str, float]] = field(default_factory=dict)  # [when][replica], idle
    marks: dict[str, float] = field(default_factory=dict)  # phase boundaries (seconds)
    phase: str = "load"
    t0: float = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0


def _error(r: httpx.Response) -> str:
    try:
        return f"{r.status_code} {r.json()['error']['type']}"
    except (ValueError, KeyError, TypeError):
        return f"{r.status_code} (no error body)"


async def _stream(c: httpx.AsyncClient, sid: str, body: dict) -> tuple[str, float | None]:
    t0 = time.monotonic()
    ttft = None
    async with c.stream("POST", f"/v1/sessions/{sid}/generate", json={"stream": True, **body}) as r:
        if r.status_code != 200:
            await r.aread()
            return _error(r), None
        event = ""
        async for line in r.aiter_lines():
            if line.startswith("event:"):
                event = line[6:].strip()
                if event == "token" and ttft is None:
                    ttft = time.monotonic() - t0
                if event == "done":
                    return "ok", ttft
            elif line.startswith("data:") and event == "error":
                return f"200 event:{json.loads(line[5:])['error']['type']}", ttft
    return "200 stream ended without done", ttft


async def _request(
    run: Run, c: httpx.AsyncClient, sid: str, kind: str, rng: random.Random, max_tokens: int
) -> None:
    t0 = time.monotonic()
    ttft = None
    try:
        if kind == "stream":
            outcome, ttft = await _stream(
                c, sid, {"prompt": " " + rng.choice(TEXT), "max_tokens": max_tokens}
            )
        elif kind == "generate":
            body = {"prompt": " " + rng.choice(TEXT), "max_tokens": max_tokens, "stream": False}
            r = await c.post(f"/v1/sessions/{sid}/generate", json=body)
            outcome = "ok" if r.status_code == 200 else _error(r)
        elif kind in ("score", "commit"):
            words = " " + " ".join(rng.choices(TEXT, k=rng.randint(2, 12)))
            r = await c.post(f"/v1/sessions/{sid}/score", json={"prompt": words, "commit": kind == "commit"})
            outcome = "ok" if r.status_code == 200 else _error(r)
        else:  # "read"
            r = await c.get(f"/v1/sessions/{sid}")
            outcome = "ok" if r.status_code == 200 else _error(r)
    except httpx.HTTPError as exc:
        outcome = f"transport {type(exc).__name__}"
    run.samples.append(Sample(run.now(), kind, outcome, time.monotonic() - t0, ttft, run.phase))


KINDS = ["stream"] * 5 + ["generate"] * 2 + ["commit"] * 2 + ["score", "read"]


async def _conversation(
    run: Run, clients: list[httpx.AsyncClient], n: int, rng: random.Random, args: argparse.Namespace
) -> None:
    c = rng.choice(clients)
    t0 = time.monotonic()
    r = await c.post("/v1/sessions", json={"prompt": " ".join(rng.choices(TEXT, k=4))})
    if r.status_code != 201:
        run.samples.append(Sample(run.now(), "create", _error(r), time.monotonic() - t0, phase=run.phase))
        return
    run.samples.append(Sample(run.now(), "create", "ok", time.monotonic() - t0, phase=run.phase))
    sid = r.json()["id"]
    for _ in range(n):
        kind = rng.choice(KINDS)
        if rng.random() < args.contention and len(clients) > 1:
            # deliberate contention: the same mutation on both replicas at once
            a, b = rng.sample(clients, 2)
            await asyncio.gather(
                _request(run, a, sid, "commit", random.Random(rng.random()), args.max_tokens),
                _request(run, b, sid, "commit", random.Random(rng.random()), args.max_tokens),
            )
        else:
            await _request(run, rng.choice(clients), sid, kind, rng, args.max_tokens)
    if args.delete:
        await rng.choice(clients).delete(f"/v1/sessions/{sid}")


def _gauges(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def _watch(run: Run, servers: dict[str, Server], stop: threading.Event, period: float) -> None:
    procs = {name: psutil.Process(s.proc.pid) for name, s in servers.items()}
    with httpx.Client(timeout=5) as http:
        while not stop.is_set():
            for name, p in procs.items():
                try:
                    run.memory[name].append((run.now(), p.memory_info().rss / 2**20))
                    g = _gauges(http.get(servers[name].url + "/metrics").text)
                    run.engine[name].append(
                        (run.now(), g["recur_hot_cache_bytes"] / 2**20, g["recur_num_requests_running"])
                    )
                except (psutil.Error, httpx.HTTPError, KeyError):
                    pass
            stop.wait(period)


async def _drive(run: Run, urls: list[str], args: argparse.Namespace, sessions: range) -> None:
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    clients = [httpx.AsyncClient(base_url=u, timeout=120, limits=limits) for u in urls]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in sessions:
        queue.put_nowait(i)

    async def client_loop() -> None:
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            await _conversation(run, clients, args.requests, random.Random(args.seed * 100_003 + i), args)

    await asyncio.gather(*(client_loop() for _ in range(args.clients)))
    for c in clients:
        await c.aclose()


def _idle_rss(servers: dict[str, Server], settle: float) -> dict[str, float]:
    """Each replica's resident memory once it has been idle for `settle` seconds (the
    median of five samples over a second)."""
    time.sleep(settle)
    samples: dict[str, list[float]] = defaultdict(list)
    for _ in range(5):
        for name, s in servers.items():
            samples[name].append(psutil.Process(s.proc.pid).memory_info().rss / 2**20)
        time.sleep(0.25)
    return {name: statistics.median(xs) for name, xs in samples.items()}


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _latency(samples: list[Sample]) -> dict:
    ok = [s for s in samples if s.outcome == "ok"]
    out = {
        "all": {
            "p50": round(_pct([s.seconds * 1000 for s in ok], 0.5), 1),
            "p99": round(_pct([s.seconds * 1000 for s in ok], 0.99), 1),
        },
        "ttft": {
            "p50": round(_pct([s.ttft * 1000 for s in ok if s.ttft is not None], 0.5), 1),
            "p99": round(_pct([s.ttft * 1000 for s in ok if s.ttft is not None], 0.99), 1),
        },
    }
    for kind in sorted({s.kind for s in samples}):
        xs = [s.seconds * 1000 for s in ok if s.kind == kind]
        out[kind] = {"n": len(xs), "p50_ms": round(_pct(xs, 0.5), 1), "p99_ms": round(_pct(xs, 0.99), 1)}
    return out


def summarise(run: Run, args: argparse.Namespace, model_desc: str) -> dict:
    load = [s for s in run.samples if s.phase == "load"]
    warmup = [s for s in run.samples if s.phase == "warmup"]
    errors = Counter(s.outcome for s in load if s.outcome != "ok")
    warmup_errors = Counter(s.outcome for s in warmup if s.outcome != "ok")
    unintended = {k: v for k, v in (errors + warmup_errors).items() if k not in INTENDED}
    start, end = run.marks["load_start"], run.marks["load_end"]
    mid = (start + end) / 2
    memory = {}
    for name, series in run.memory.items():
        before = run.idle_mib.get("after_warmup", {}).get(name, series[0][1])
        after = run.idle_mib["after_load"][name]
        cache = [mib for t, mib, _ in run.engine[name] if t <= run.marks.get("warmup_end", 0.0)]
        memory[name] = {
            "start_mib": round(series[0][1], 1),
            "idle_after_warmup_mib": round(before, 1),
            "idle_after_load_mib": round(after, 1),
            "growth_after_warmup": round(after / before - 1, 4),
            "under_load_mib": {
                "first_half_median": round(statistics.median(m for t, m in series if start <= t < mid), 1),
                "second_half_median": round(statistics.median(m for t, m in series if mid <= t <= end), 1),
                "peak": round(max(m for t, m in series if start <= t <= end), 1),
            },
            "hot_cache_after_warmup_mib": round(cache[-1], 1) if cache else None,
            "hot_cache_full_after_warmup": bool(cache) and cache[-1] >= 0.95 * args.hot_cache_mb,
            "max_running_batch": int(max((b for _, _, b in run.engine[name]), default=0)),
        }
    return {
        "model": model_desc,
        "sessions": args.sessions,
        "requests_per_session": args.requests,
        "warmup_sessions": args.warmup_sessions,
        "clients": args.clients,
        "replicas": args.replicas,
        "max_tokens": args.max_tokens,
        "hot_cache_mb": args.hot_cache_mb,
        "malloc_trim_interval_s": args.malloc_trim_interval,
        "seed": args.seed,
        "load_duration_s": round(end - start, 1),
        "requests": len(load),
        "requests_per_s": round(len(load) / (end - start), 1),
        "errors": dict(errors),
        "warmup_requests": len(warmup),
        "warmup_errors": dict(warmup_errors),
        "unintended_errors": unintended,
        "latency_ms": _latency(load),
        "memory": memory,
        "marks_s": {k: round(v, 1) for k, v in run.marks.items()},
        # the raw series (every 5th memory sample), to re-read the run without running it again
        "memory_series_mib": {
            n: [[round(t, 1), round(m, 1)] for t, m in s[::5]] for n, s in run.memory.items()
        },
        "passed": not unintended and all(m["growth_after_warmup"] < 0.10 for m in memory.values()),
    }


def plot(run: Run, summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_eng, ax_lat) = plt.subplots(
        3, 1, figsize=(9, 9.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.5, 3]}
    )
    for i, (name, series) in enumerate(sorted(run.memory.items())):
        ax_mem.plot([t for t, _ in series], [m for _, m in series], color=f"C{i}", label=f"replica {name}")
        eng = run.engine.get(name, [])
        ax_eng.plot(
            [t for t, _, _ in eng], [m for _, m, _ in eng], color=f"C{i}", label=f"hot cache {name} (MiB)"
        )
        ax_eng.plot([t for t, _, _ in eng], [b for _, _, b in eng], color=f"C{i}", lw=0.6, alpha=0.6, ls=":",
                    label=f"running batch {name}")  # fmt: skip
    marks = run.marks
    for ax in (ax_mem, ax_eng, ax_lat):
        if "warmup_end" in marks:
            ax.axvspan(0, marks["warmup_end"], color="grey", alpha=0.12, lw=0)
        for a, b in (("warmup_end", "load_start"), ("load_end", "idle_end")):
            if a in marks and b in marks:
                ax.axvspan(marks[a], marks[b], color="C2", alpha=0.15, lw=0)
    for i, name in enumerate(sorted(run.memory)):
        for when, a, b in (
            ("after_warmup", "warmup_end", "load_start"),
            ("after_load", "load_end", "idle_end"),
        ):
            if name in run.idle_mib.get(when, {}) and a in marks:
                ax_mem.plot([marks[b]], [run.idle_mib[when][name]], "o", color=f"C{i}", ms=6)
    ax_mem.plot([], [], "o", color="k", ms=5, label="idle (compared: growth after warm-up)")
    ax_mem.axvspan(0, 0, color="grey", alpha=0.12, label="warm-up")
    ax_mem.axvspan(0, 0, color="C2", alpha=0.15, label="idle")
    ax_mem.set_ylabel("resident memory (MiB)")
    ax_mem.legend(loc="lower right", fontsize=8)
    ax_eng.set_ylabel("hot cache MiB / batch rows")
    ax_eng.legend(loc="lower right", fontsize=7, ncol=3)
    growth = ", ".join(f"{n} {m['growth_after_warmup']:+.1%}" for n, m in sorted(summary["memory"].items()))
    ax_mem.set_title(
        f"soak: {summary['warmup_sessions']} warm-up + {summary['sessions']} sessions x "
        f"{summary['requests_per_session']} requests, {summary['clients']} clients, {summary['replicas']} replicas"
        f"\nmemory growth after warm-up (idle to idle): {growth}"
    )
    _plot_latency(ax_lat, run, summary)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _plot_latency(ax_lat: Any, run: Run, summary: dict) -> None:
    """The bottom panel: every request's latency, rolling p50 and p99 per phase, the refusals."""
    ok = sorted((s for s in run.samples if s.outcome == "ok"), key=lambda s: s.t)
    ax_lat.scatter([s.t for s in ok], [s.seconds * 1000 for s in ok], s=3, alpha=0.3, label="request latency")
    for k, phase in enumerate(("warmup", "load")):  # rolling percentiles, per phase
        xs = [s for s in ok if s.phase == phase]
        window = max(1, len(xs) // 30)
        mids, p50, p99 = [], [], []
        for i in range(0, len(xs), window):
            chunk = [s.seconds * 1000 for s in xs[i : i + window]]
            mids.append(xs[min(i + window // 2, len(xs) - 1)].t)
            p50.append(_pct(chunk, 0.5))
            p99.append(_pct(chunk, 0.99))
        ax_lat.plot(mids, p50, color="C1", label=None if k else "p50 (rolling)")
        ax_lat.plot(mids, p99, color="C3", label=None if k else "p99 (rolling)")
    bad = [s for s in run.samples if s.outcome != "ok"]
    if bad:
        ax_lat.scatter([s.t for s in bad], [s.seconds * 1000 for s in bad], s=12, marker="x", color="k",
                       label="409/429 (intended)" if not summary["unintended_errors"] else "errors")  # fmt: skip
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("latency (ms)")
    ax_lat.set_xlabel("seconds since the warm-up began")
    ax_lat.legend(loc="upper right", fontsize=8)


def _model(name: str) -> tuple[str, str]:
    import model

    if name in model.shipped() or Path(name).is_dir():
        return name, f"`{name}`"
    # no such model here: a random one of the shipped RLT's size (load does not depend on weights)
    cfg = dict(n_encoder_layers=2, n_decoder_layers=2, d_model=128, n_head=4, d_ff=256, window=16,
               memory_groups=2, max_context=128, tgt_len=64)  # fmt: skip
    path = Path(tempfile.mkdtemp(prefix="recur-soak-")) / "model"
    model.init(path, family="rlt", seed=0, **cfg)
    return str(path), "`recur init --family rlt` of the shipped RLT's size"


def _load(servers: list[Server], args: argparse.Namespace) -> Run:
    """The warm-up, then the load, with the replicas' memory watched throughout."""
    run = Run()
    stop = threading.Event()
    named = {chr(ord("a") + i): s for i, s in enumerate(servers)}
    urls = [s.url for s in servers]
    run.t0 = time.monotonic()
    watcher = threading.Thread(target=_watch, args=(run, named, stop, 0.5), daemon=True)
    watcher.start()
    if args.warmup_sessions:
        run.phase = "warmup"
        # (session numbers after the load's, so the load is the same with or without it)
        asyncio.run(_drive(run, urls, args, range(args.sessions, args.sessions + args.warmup_sessions)))
        run.marks["warmup_end"] = run.now()
        run.idle_mib["after_warmup"] = _idle_rss(named, args.settle)
        print(f"soak: warm-up done; idle MiB {run.idle_mib['after_warmup']}", flush=True)
    run.phase = "load"
    run.marks["load_start"] = run.now()
    asyncio.run(_drive(run, urls, args, range(args.sessions)))
    run.marks["load_end"] = run.now()
    run.idle_mib["after_load"] = _idle_rss(named, args.settle)
    run.marks["idle_end"] = run.now()
    stop.set()
    watcher.join()
    return run


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shakespeare-rlt", help="shipped model name or checkpoint directory")
    p.add_argument("--sessions", type=int, default=200)
    p.add_argument("--requests", type=int, default=10, help="requests per session (after its creation)")
    p.add_argument("--clients", type=int, default=32, help="concurrent clients")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per generation")
    p.add_argument("--contention", type=float, default=0.02, help="share of requests deliberately doubled")
    p.add_argument(
        "--hot-cache-mb",
        type=float,
        default=32,
        help="each replica's hot state cache: small enough to fill during warm-up, so growth after it "
        "measures leaks, not the bounded cache filling up as designed (the summary says whether it did)",
    )
    p.add_argument(
        "--warmup-sessions",
        type=int,
        default=100,
        help="conversations run before the load, to fill the hot caches and reach the largest batches",
    )
    p.add_argument(
        "--malloc-trim-interval", type=float, default=5.0, help="the replicas' RECUR_MALLOC_TRIM_INTERVAL"
    )
    p.add_argument("--settle", type=float, default=5.0, help="seconds idle before each idle sample")
    p.add_argument("--delete", action="store_true", help="delete each session at the end of its conversation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "results" / "soak" / "soak.png")
    p.add_argument("--json", type=Path, default=ROOT / "docs" / "results" / "soak" / "soak.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    model_arg, model_desc = _model(args.model)
    work = Path(tempfile.mkdtemp(prefix="recur-soak-"))
    redis = Redis(work / "redis", "--appendonly", "yes", "--appendfsync", "everysec")
    servers: list[Server] = []
    try:
        for i in range(args.replicas):
            servers.append(
                Server(
                    model_arg,
                    redis.url,
                    work / f"replica-{i}",
                    key_prefix="soak:",
                    cpu_threads=1,
                    hot_cache_mb=args.hot_cache_mb,
                    malloc_trim_interval=args.malloc_trim_interval,
                )
            )
        print(f"soak: {len(servers)} replicas up ({model_desc}); driving the load", flush=True)
        run = _load(servers, args)
    finally:
        for s in servers:
            s.stop()
        redis.stop()
    summary = summarise(run, args, model_desc)
    plot(run, summary, args.plot)
    args.json.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"plot: {args.plot}\nsummary: {args.json}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
