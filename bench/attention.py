"""A decode step's attention over many rows' windows (model/attention.py, `_fused`): the two
products (scores, then values, one softmax between them), against torch's fused CPU
attention kernel with the sinks merged by log-sum-exp, side by side in one run, against the
machine's read bandwidth measured in the same run (`roofline.read_bandwidth`).

Part 1, the attention alone: SmolLM2-135M's shape (30 layers, 3 key/value heads of 64
serving 9 query heads, 4 sinks), each row's window in an arena as a served batch holds it;
the 30 layers' attention of one step, at 1 and 16 rows and K keys. Part 2, the whole step:
the shipped smollm2 (`--precision`), 16 rows after `--history` tokens each, one decode step,
the two paths alternating in one process, each step from the one before.

    python bench/attention.py [--threads 1] [--history 512] [--precision int4,fp32] [--no-step]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import TypeVar

import torch
from harness import write_section
from roofline import read_bandwidth

import model
from model import attention

LAYERS, KVH, GROUP, HD, SINKS = 30, 3, 3, 64, 4
R = TypeVar("R")
SECTION = "## Attention over many rows"
WHAT = [
    "A decode step's attention (model/attention.py): the two products (scores, then values) read each row's "
    "keys and values apart; torch's fused CPU attention kernel reads them once, its sums in fp32, and the "
    "sinks (their own query) join it by log-sum-exp. The model takes the fused kernel for one query per "
    "row and more than one row (`_fused`); one row, where the step is the calls between kernels, keeps "
    "the products. Both paths alternate in one run.",
]


def alternating(paths: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """The median seconds of each path's call, the paths taking turns round by round."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for f in paths.values():
        f()  # warm-up
    for _ in range(rounds):
        for name, f in paths.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def _one_query(qg: torch.Tensor, win: attention.Pair, T: int) -> bool:
    return T == 1


def _never(qg: torch.Tensor, win: attention.Pair, T: int) -> bool:
    return False


def switched(on: bool, f: Callable[[], R]) -> Callable[[], R]:
    """f with the fused path taken wherever there is one query per row, one row too (on), or
    never (off); the model takes it from two rows up (`model.attention._fused`)."""
    fused = attention._fused

    def run() -> R:
        attention._fused = _one_query if on else _never
        try:
            return f()
        finally:
            attention._fused = fused

    return run


def layers(rows: int, keys: int) -> Callable[[], list[torch.Tensor]]:
    """One step's attention, 30 layers of random keys and values in an arena."""
    D = KVH * HD
    arena_k, arena_v = torch.randn(rows, LAYERS, keys + 8, D), torch.randn(rows, LAYERS, keys + 8, D)
    sinks_k, sinks_v = torch.randn(rows, LAYERS, SINKS, D), torch.randn(rows, LAYERS, SINKS, D)
    q, q_sink = (
        torch.randn(rows, LAYERS, KVH, GROUP, HD) * 0.3,
        torch.randn(rows, LAYERS, KVH, GROUP, HD) * 0.3,
    )

    def run() -> list[torch.Tensor]:
        out = []
        for i in range(LAYERS):
            window = (
                attention._heads(arena_k[:, i, :keys], KVH),
                attention._heads(arena_v[:, i, :keys], KVH),
            )
            sinks = (attention._heads(sinks_k[:, i], KVH), attention._heads(sinks_v[:, i], KVH))
            out.append(attention._apart(q[:, i], q_sink[:, i], window, sinks, (None, None), 1))
        return out

    return run


def part_one(threads: int, rounds: int) -> list[str]:
    """The attention alone, both paths, at 1 and 16 rows: the table's lines."""
    torch.set_num_threads(threads)
    bandwidth = read_bandwidth(threads)
    lines = [
        f"The 30 layers' attention of one decode step, {threads} thread(s); this run read "
        f"{bandwidth / 1e9:.2f} GB/s (`roofline.read_bandwidth`); the fused column forced at one row too:",
        "",
        "| rows | keys | MB read | products, ms | fused, ms | speed | fused, of the bandwidth | largest difference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for rows, keys in ((1, 513), (1, 1024), (16, 513), (16, 1024)):
        run = layers(rows, keys)
        apart = zip(switched(False, run)(), switched(True, run)(), strict=True)
        same = max((a - b).abs().max().item() for a, b in apart)
        t = alternating({"products": switched(False, run), "fused": switched(True, run)}, rounds)
        nbytes = rows * LAYERS * 2 * (keys + SINKS) * KVH * HD * 4
        lines.append(
            f"| {rows} | {keys} | {nbytes / 1e6:.1f} | {t['products'] * 1e3:.2f} | {t['fused'] * 1e3:.2f} | "
            f"{t['products'] / t['fused']:.2f}x | {nbytes / t['fused'] / bandwidth:.0%} | {same:.1e} |"
        )
    return lines


def part_two(threads: int, precision: str, history: int, rounds: int) -> str:
    """smollm2's whole 16-row step, both paths: the table's line."""
    torch.set_num_threads(threads)
    lm = model.load("smollm2", device="cpu", precision=precision)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        rows = [lm.consume(torch.randint(100, 40000, (history,), generator=g).tolist(), lm.new_state(1))[1]
                for _ in range(16)]  # fmt: skip
        tokens = torch.full((16, 1), 42)
        _, state = lm(tokens, lm.stack_states(rows))  # (into an arena, as a served batch decodes)
        states = [state]

        def step() -> object:  # each step from the last one's state, grown in place
            logits, states[0] = lm(tokens, states[0])
            return logits

        t = alternating({"products": switched(False, step), "fused": switched(True, step)}, rounds)
    return (
        f"| {precision} | {history} | {t['products'] * 1e3:.1f} | {t['fused'] * 1e3:.1f} | "
        f"{t['products'] / t['fused']:.2f}x | {16 / t['products']:.1f} | {16 / t['fused']:.1f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--history", type=int, default=512)
    ap.add_argument("--precision", default="int4,fp32")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--no-step", action="store_true", help="the attention alone, not the whole step")
    ap.add_argument("--write", action="store_true", help="put the section into docs/BENCHMARKS.md")
    args = ap.parse_args()
    lines = [SECTION, "", *WHAT, "", *part_one(args.threads, args.rounds)]
    if not args.no_step:
        lines += ["", f"smollm2's whole decode step, 16 rows after {args.history} tokens each, {args.threads} thread(s):",
                  "", "| weights | history | products, ms | fused, ms | speed | tokens/s, products | tokens/s, fused |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        lines += [part_two(args.threads, p, args.history, args.rounds) for p in args.precision.split(",")]
    lines += [
        "",
        f"Reproduce: `python bench/attention.py --threads {args.threads}` (`--write` rewrites this section).",
        "",
    ]
    print("\n".join(lines))
    if args.write:
        write_section(SECTION, "\n".join(lines))


if __name__ == "__main__":
    main()
