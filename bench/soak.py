"""Soak: sustained load on two replicas sharing one Redis, watching errors, latency and the
replicas' resident memory. Not a test: run it by hand (it takes minutes), e.g.

    nice -n 10 .venv/bin/python bench/soak.py                  # 200 sessions x 10 requests
    nice -n 10 .venv/bin/python bench/soak.py --sessions 40    # a quick look

It starts a redis-server (AOF everysec) and `--replicas` servers itself, then drives
`--sessions` conversations of `--requests` requests each from `--clients` concurrent
asyncio clients. A conversation hops between replicas at random; its requests are a mix
of streaming and non-streaming generations and scores (committed or not). A few requests
are deliberately doubled, sent to both replicas at once: one of the pair must get
409 session_busy, the only error besides 429 (queue full) that counts as intended.

It reports errors by type, p50/p99 latency by kind, each replica's resident memory over
time and its growth after warm-up (must stay under 10%), writes a PNG plot and a JSON
summary, and exits non-zero if an unintended error occurred or memory grew too much.

Warm-up is measured, not assumed: it ends when every replica's hot state cache (read from
its /metrics) is full, and no earlier than `--warmup` of the run. A session's state grows
with its conversation, so the cache fills only once conversations have run for a while;
until then resident memory rises by design (the cache is bounded by its budget), and
growth after that point is what would be a leak. Once the load stops, each replica's
memory is sampled again when idle.
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


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    memory: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))
    # per replica, from its /metrics: (t, hot cache MiB, sessions in the running batch)
    engine: dict[str, list[tuple[float, float, float]]] = field(default_factory=lambda: defaultdict(list))
    idle_mib: dict[str, float] = field(default_factory=dict)  # once the load has stopped
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
    run.samples.append(Sample(run.now(), kind, outcome, time.monotonic() - t0, ttft))


KINDS = ["stream"] * 5 + ["generate"] * 2 + ["commit"] * 2 + ["score", "read"]


async def _conversation(
    run: Run, clients: list[httpx.AsyncClient], n: int, rng: random.Random, args: argparse.Namespace
) -> None:
    c = rng.choice(clients)
    t0 = time.monotonic()
    r = await c.post("/v1/sessions", json={"prompt": " ".join(rng.choices(TEXT, k=4))})
    if r.status_code != 201:
        run.samples.append(Sample(run.now(), "create", _error(r), time.monotonic() - t0))
        return
    run.samples.append(Sample(run.now(), "create", "ok", time.monotonic() - t0))
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


def _warmup_end(run: Run, args: argparse.Namespace, end: float) -> tuple[float, str]:
    """When warm-up ended: every replica's hot cache full (95% of its budget), and not
    before `args.warmup` of the run."""
    floor = args.warmup * end
    full = []
    for series in run.engine.values():
        t = next((t for t, mib, _ in series if mib >= 0.95 * args.hot_cache_mb), None)
        if t is None:
            return floor, f"{args.warmup:.0%} of the run (a hot cache never filled)"
        full.append(t)
    if not full or max(full) <= floor:
        return floor, f"{args.warmup:.0%} of the run (the hot caches were full by then)"
    return max(full), "every replica's hot cache full"


async def _drive(run: Run, urls: list[str], args: argparse.Namespace) -> None:
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    clients = [httpx.AsyncClient(base_url=u, timeout=120, limits=limits) for u in urls]
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(args.sessions):
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


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarise(run: Run, args: argparse.Namespace, model_desc: str) -> dict:
    ok = [s for s in run.samples if s.outcome == "ok"]
    errors = Counter(s.outcome for s in run.samples if s.outcome != "ok")
    end = max(s.t for s in run.samples)
    warm, warm_reason = _warmup_end(run, args, end)
    by_kind = {}
    for kind in sorted({s.kind for s in run.samples}):
        xs = [s.seconds * 1000 for s in ok if s.kind == kind]
        by_kind[kind] = {"n": len(xs), "p50_ms": round(_pct(xs, 0.5), 1), "p99_ms": round(_pct(xs, 0.99), 1)}
    ttft = [s.ttft * 1000 for s in ok if s.ttft is not None]
    memory = {}
    for name, series in run.memory.items():
        # baseline: the first `--window` seconds after warm-up; final: the run's last ones.
        # Medians over windows spanning a few malloc_trim periods, so neither a spike nor
        # where a sample falls in the trim cycle decides the figure.
        after = [(t, m) for t, m in series if t >= warm]
        base = statistics.median(m for t, m in after if t <= warm + args.window)
        final = statistics.median(m for t, m in after if t >= end - args.window)
        memory[name] = {
            "start_mib": round(series[0][1], 1),
            "after_warmup_mib": round(base, 1),
            "end_mib": round(final, 1),
            "peak_mib": round(max(m for _, m in series), 1),
            "growth_after_warmup": round(final / base - 1, 4),
            "idle_after_load_mib": round(run.idle_mib[name], 1) if name in run.idle_mib else None,
            "hot_cache_end_mib": round(run.engine[name][-1][1], 1) if run.engine[name] else None,
            "max_running_batch": int(max((b for _, _, b in run.engine[name]), default=0)),
        }
    unintended = {k: v for k, v in errors.items() if k not in INTENDED}
    return {
        "model": model_desc,
        "sessions": args.sessions,
        "requests_per_session": args.requests,
        "clients": args.clients,
        "replicas": args.replicas,
        "max_tokens": args.max_tokens,
        "hot_cache_mb": args.hot_cache_mb,
        "malloc_trim_interval_s": args.malloc_trim_interval,
        "duration_s": round(end, 1),
        "requests": len(run.samples),
        "requests_per_s": round(len(run.samples) / end, 1),
        "errors": dict(errors),
        "unintended_errors": unintended,
        "latency_ms": {
            "all": {
                "p50": round(_pct([s.seconds * 1000 for s in ok], 0.5), 1),
                "p99": round(_pct([s.seconds * 1000 for s in ok], 0.99), 1),
            },
            "ttft": {"p50": round(_pct(ttft, 0.5), 1), "p99": round(_pct(ttft, 0.99), 1)},
            **by_kind,
        },
        "memory": memory,
        "warmup_s": round(warm, 1),
        "warmup_ended": warm_reason,
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
    for ax in (ax_mem, ax_eng):
        ax.axvline(summary["warmup_s"], color="grey", ls="--", lw=1, label="end of warm-up")
    ax_mem.set_ylabel("resident memory (MiB)")
    ax_mem.legend(loc="lower right")
    ax_eng.set_ylabel("hot cache MiB / batch rows")
    ax_eng.legend(loc="lower right", fontsize=7, ncol=3)
    ax_mem.set_title(
        f"soak: {summary['sessions']} sessions x {summary['requests_per_session']} requests, "
        f"{summary['clients']} clients, {summary['replicas']} replicas"
    )
    ok = sorted((s for s in run.samples if s.outcome == "ok"), key=lambda s: s.t)
    ax_lat.scatter([s.t for s in ok], [s.seconds * 1000 for s in ok], s=3, alpha=0.3, label="request latency")
    window = max(1, len(ok) // 40)
    mids, p50, p99 = [], [], []
    for i in range(0, len(ok), window):
        chunk = [s.seconds * 1000 for s in ok[i : i + window]]
        mids.append(ok[min(i + window // 2, len(ok) - 1)].t)
        p50.append(_pct(chunk, 0.5))
        p99.append(_pct(chunk, 0.99))
    ax_lat.plot(mids, p50, color="C1", label="p50 (rolling)")
    ax_lat.plot(mids, p99, color="C3", label="p99 (rolling)")
    bad = [s for s in run.samples if s.outcome != "ok"]
    if bad:
        ax_lat.scatter([s.t for s in bad], [s.seconds * 1000 for s in bad], s=12, marker="x", color="k",
                       label="409/429 (intended)" if not summary["unintended_errors"] else "errors")  # fmt: skip
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("latency (ms)")
    ax_lat.set_xlabel("seconds since the load began")
    ax_lat.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


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


def main(argv: list[str] | None = None) -> int:
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
        "measures leaks, not the bounded cache filling up as designed",
    )
    p.add_argument("--warmup", type=float, default=0.2, help="share of the run counted as warm-up")
    p.add_argument("--window", type=float, default=10.0, help="seconds averaged for the growth's two ends")
    p.add_argument(
        "--malloc-trim-interval", type=float, default=5.0, help="the replicas' RECUR_MALLOC_TRIM_INTERVAL"
    )
    p.add_argument("--settle", type=float, default=5.0, help="seconds idle before the after-load sample")
    p.add_argument("--delete", action="store_true", help="delete each session at the end of its conversation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, default=ROOT / "docs" / "soak.png")
    p.add_argument("--json", type=Path, default=ROOT / "docs" / "soak.json")
    args = p.parse_args(argv)

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
        run = Run()
        stop = threading.Event()
        named = {chr(ord("a") + i): s for i, s in enumerate(servers)}
        run.t0 = time.monotonic()
        watcher = threading.Thread(target=_watch, args=(run, named, stop, 0.5), daemon=True)
        watcher.start()
        asyncio.run(_drive(run, [s.url for s in servers], args))
        stop.set()
        watcher.join()
        time.sleep(args.settle)  # the load has stopped: what does each replica keep?
        run.idle_mib = {n: psutil.Process(s.proc.pid).memory_info().rss / 2**20 for n, s in named.items()}
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
