"""One stream's decode step: the calls around its kernels, today's model/ against an earlier one.

A batch-1 eager decode step of the shipped smollm2 reads every weight once, and on a CPU its
products take less of it than the PyTorch calls between them (issue 42: batch 1 against
llama.cpp). This bench measures what the commit after BASE changed there: one stream's
attention on 3-D views with one `bmm` a product (`model.attention._one_query`), a query
turned for the window and the sinks in one product (`model.rotary.rotate_twice`), and the
packed linears' kernels called with fewer reshapes. Every result is the same to the bit
(tests/model/test_llama.py), so only the time can differ.

Per weight precision (fp32, int8, int4) and thread count: section 11's batch-1 step
(bench/llm_peers.py's `stepper`: greedy, after its 600-character prompt), each side in a
process of its own with its model/ first on the path, the sides alternating over rounds,
each one's best median step; the step's profile (its ops and its kernels' share of its
time, bench/roofline.py's `breakdown`, as section 9 reads them); and the machine's limit, measured in the same run: the bytes a step reads (its
weights and its window, bench/llm.py's `llama_work`) at the read bandwidth of that many
threads (bench/roofline.py's `read_bandwidth`, best of the run's start and end).

`--write` puts the section "## One stream's decode step" into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
from harness import beside_arguments, beside_rows, publish, read_limit, started

SECTION = "## One stream's decode step"
BASE = "edd0bff"  # the commit before one stream's step went to fewer calls
PRECISIONS = ("fp32", "int8", "int4")


def measure(precision: str, threads: int, steps: int) -> dict:
    """This process's model/: the step's tokens/s (best of 3 medians), its profile (ops a
    step and the kernels' share, bench/roofline.py's `breakdown`, as section 9 counts them)
    and the bytes it reads."""
    import llm_peers as peers
    from llm import llama_work
    from roofline import breakdown, profile

    import model

    torch.set_num_threads(threads)
    lm = model.load("smollm2", device="cpu", precision=precision)
    step = peers.stepper(lm)
    for _ in range(10):
        step()
    rate = max(peers.rate(step, steps) for _ in range(3))
    with profile() as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - t0
    bytes_read = llama_work(lm, peers.prompt_state(lm)).bytes
    return {"tokens_per_s": rate, **breakdown(prof, steps, wall), "bytes": bytes_read}


def section(r: dict) -> str:
    lines = [
        SECTION,
        "",
        f"`python bench/one_stream.py` (`--write` rewrites this section): the shipped smollm2's batch-1 eager "
        "decode step (section 11's, after the same prompt), commit "
        f"{BASE}'s model/ and today's, each in a process of its own, alternating over {r['rounds']} rounds, each "
        f"one's best median of {r['steps']} steps; " + read_limit(r),
        "",
        "| weights | threads | ops a step, before | today | kernels' share, before | today | tokens/s before "
        "| today | today ÷ before | MB a step | the read limit, tokens/s | today's share of it |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in r["rows"]:
        b, t = d["base"], d["today"]
        limit = r["bandwidth"][str(d["threads"])] / t["bytes"]
        lines.append(
            f"| {d['precision']} | {d['threads']} | {b['ops_per_call']:,} | {t['ops_per_call']:,} | "
            f"{b['kernel_share']:.0%} | {t['kernel_share']:.0%} | {b['tokens_per_s']:.1f} | "
            f"{t['tokens_per_s']:.1f} | {t['tokens_per_s'] / b['tokens_per_s']:.2f}x | {t['bytes'] / 1e6:.1f} | "
            f"{limit:.1f} | {t['tokens_per_s'] / limit:.0%} |"
        )
    ratios = [d["today"]["tokens_per_s"] / d["base"]["tokens_per_s"] for d in r["rows"]]
    lines += [
        "",
        f"Today ÷ before: median {statistics.median(ratios):.2f}x over the {len(ratios)} rows. The same products "
        "run on both sides and every result is the same to the bit; what a step lost to the calls between its "
        "kernels is what changed. What still keeps a step from its read limit: the time outside its kernels "
        "(the rest of the kernels' share above: the Python and dispatch between them, which do not scale with "
        "threads; the profiler adds a little to every op, so that share reads a bit low) and kernels below the "
        'read rate. A compiled step removes most of the calls (`--compile`, section "Packed weights").',
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    from roofline import read_bandwidth

    ap = beside_arguments(__doc__, PRECISIONS)
    ap.add_argument("--steps", type=int, default=40, help="timed steps per median")
    args = ap.parse_args()
    if args.side:
        precision, threads = args.side.split(",")
        print("RESULT " + json.dumps(measure(precision, int(threads), args.steps)))
        return
    threads = [int(t) for t in args.threads.split(",")]
    r = started(rounds=args.rounds, steps=args.steps)
    bandwidth = {str(t): read_bandwidth(t) for t in threads}
    rows = beside_rows("one_stream.py", BASE, args, ("--steps", str(args.steps)))
    r["bandwidth"] = {str(t): max(bandwidth[str(t)], read_bandwidth(t)) for t in threads}
    r["rows"] = rows
    r["load"].append(os.getloadavg()[0])
    publish(SECTION, section(r), r, args.write)


if __name__ == "__main__":
    main()
