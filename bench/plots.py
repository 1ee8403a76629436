"""The plots of docs/BENCHMARKS.md, written under docs/results/bench/ (bench/report.py)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PLOTS = Path(__file__).resolve().parent.parent / "docs" / "results" / "bench"


def _save(fig: plt.Figure, name: str) -> str:
    """Write a plot under docs/results/bench/ and return its path relative to docs/."""
    fig.tight_layout()
    fig.savefig(PLOTS / f"{name}.png", dpi=120)
    plt.close(fig)
    return f"results/bench/{name}.png"


def plot_history(rows: list[dict]) -> str:
    xs = [r["history_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(xs, [r["stateful_ms"] for r in rows], "o-", label="recur session (state in Redis)")
    ax.plot(xs, [r["stateless_ms"] for r in rows], "s--", label="stateless: re-send + re-prefill history")
    ax.set(xscale="log", yscale="log", xlabel="history (tokens)", ylabel="32-token request (ms)")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, "history")


def plot_speedup(rows: list[dict]) -> str:
    xs = [r["attention_length"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(xs, [r["speedup"] for r in rows], "o-", label="recur, this machine")
    ax.plot(xs, [r["paper"] for r in rows], "s--", label="Dai et al. 2019 (GPU)")
    ax.set(xlabel="attention length", ylabel="speedup over recompute (x)")
    ax.legend()
    ax.grid(alpha=0.3)
    return _save(fig, "speedup")


def plot_concurrency(rows: list[dict]) -> str:
    xs = [r["concurrency"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.6))
    a.plot(xs, [r["tokens_per_s"] for r in rows], "o-")
    a.set(xscale="log", xlabel="concurrent streams", ylabel="aggregate tokens/s")
    b.plot(xs, [r["itl_p50_ms"] for r in rows], "o-", label="ITL p50")
    b.plot(xs, [r["itl_p99_ms"] for r in rows], "s--", label="ITL p99")
    b.plot(xs, [r["ttft_p50_ms"] for r in rows], "^:", label="TTFT p50")
    b.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="ms")
    b.legend()
    for ax in (a, b):
        ax.grid(alpha=0.3)
    return _save(fig, "concurrency")


def plot_persistence(rows: list[dict]) -> str:
    names = [r["config"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.barh(names, [r["read_ms"] for r in rows], label="read ms")
    ax.barh(names, [r["write_ms"] for r in rows], left=[r["read_ms"] for r in rows], label="write ms")
    ax.set(xlabel="ms per 64-token request")
    ax.legend()
    return _save(fig, "persistence")


def plot_roofline(roof: dict) -> str:
    """The classic roofline: achieved GFLOP/s against FLOPs per byte, under the 1-thread
    read bandwidth's slope and the 1-thread GEMM rate's ceiling."""
    m = roof["machine"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    rows = roof["decode"]
    lo = min(r["mflop_per_step"] / r["mb_per_step"] for r in rows) / 2
    hi = max(r["mflop_per_step"] / r["mb_per_step"] for r in rows) * 4
    xs = [lo * (hi / lo) ** (i / 50) for i in range(51)]
    ax.plot(xs, [min(x * m["bandwidth_1t"], m["gemm_1t"]) for x in xs], "k-", label="roofline, 1 thread")
    ax.plot(xs, [min(x * m["gemv_1t"], m["gemm_1t"]) for x in xs], "k:", label="batch-1 linear's read rate")
    for i, name in enumerate(dict.fromkeys(r["model"] for r in rows)):
        mine = [r for r in rows if r["model"] == name]
        ix = [r["mflop_per_step"] / r["mb_per_step"] for r in mine]
        gf = [r["mflop_per_step"] / r["step_ms"] for r in mine]  # MFLOP/ms = GFLOP/s
        ax.plot(ix, gf, "os^D"[i % 4] + "-", label=name)
        for j, (x, y, r) in enumerate(zip(ix, gf, mine, strict=True)):
            ax.annotate(
                f"B{r['batch']}", (x, y), textcoords="offset points", xytext=(4, (-10, 4)[j % 2]), fontsize=7
            )
    ax.set(xscale="log", yscale="log", xlabel="FLOPs per byte moved", ylabel="GFLOP/s achieved")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    return _save(fig, "roofline")
