"""A compiled step's guards: what dynamo checks before every call, with and without the model's.

Before each call of a compiled function dynamo checks its guards: the conditions under which
the graph it traced still computes the same thing. Traced through a model's forward, most of
them are on the model (every parameter's and buffer's identity, shape and stride, every config
value read); the engine compiles one model it never changes, so it drops those and keeps the
ones on the step's inputs (app/engine/compiler.py's `guards_kept`). This bench measures what
that changes on the shipped smollm2's batch-1 decode step (bench/llm_peers.py's `stepper`:
greedy, after section 11's prompt), side by side in one process per thread count: the eager
step, the compiled step checking every guard, the compiled step as the engine compiles it,
and, with `--llama-cpp`, llama.cpp on the same GGUF with the same threads (bench/llm_peers.py
builds it). The steppers alternate over rounds, each one's best median step counting. Per
compiled variant: its guards (how many it checks), and the time dynamo's cache lookup (the
guards) takes a step under the profiler. The machine's limit, measured in the same run: the
bytes a step reads (weights and window, bench/llm.py's `llama_work`) at the read bandwidth of
that many threads (bench/roofline.py's `read_bandwidth`, best of the run's start and end).

`--write` puts the section "## A compiled step's guards" into docs/BENCHMARKS.md. The compiles
take minutes each on 2 cores (inductor's cache makes the second variant's short).
"""

from __future__ import annotations

import json
import statistics

import torch
from harness import by_thread_count, publish, read_limit, step_arguments, step_table

SECTION = "## A compiled step's guards"
VARIANTS = ("eager", "every guard", "the inputs' guards")
# what the run cannot show: the compiled step's own profile, and how its window came to grow in place
LEFT = (
    "What the compiled step still spends beyond the bytes it reads (a profile of its generated kernels, "
    "int4, 2 threads, 7 Dec, `torch._inductor.config.cpp.enable_kernel_profile`; the profiler inflates "
    "every kernel): the int4 kernel about a third of the step; the window grown functionally, a quarter "
    "(each layer's keys and values copied into a new tensor beside the rotary embedding, and the 30 "
    "layers' stacked into the state at the end); the masked softmax, the attention's products and the "
    "int8 head the rest. Since then one stream's compiled step appends its window in place (section \"The "
    "compiled step's window\", `bench/compiled_window.py`): inductor (torch 2.13) writes a slice of a "
    "graph input in place when the input is that layer's own tensor, and copies the whole arena when the "
    "layer is a view of one [B, L, capacity, D] input taken inside the graph, so each arena is readied "
    "outside the graph and its layers handed in one by one (`model.compiled_in_place`). Not for several "
    "rows: AOTAutograd gives the views' base symbols that dynamo's guards cannot name once the batch is "
    "symbolic (`sources must not be empty for symbol`, on every compile that misses inductor's cache), "
    'which is what failed "in some runs" before: the runs whose cache was cold.'
)


def compiled_step(lm, every_guard: bool) -> tuple:
    """`lm`'s compiled step as the engine builds it (`compiler._compile`), checking every guard
    or the engine's (`guards_kept`) -> (step, the guards it checks: a list filled as it compiles)."""
    from app.engine import compiler

    kept_by_engine = compiler.guards_kept
    checked: list[str] = []

    def kept(entries: list) -> list[bool]:
        keep = [True] * len(entries) if every_guard else kept_by_engine(entries)
        checked.extend(e.name for e, k in zip(entries, keep, strict=True) if k)
        return keep

    compiler.guards_kept = kept  # (read when `_compile` builds its options)
    try:
        return compiler._compile(lm), checked
    finally:
        compiler.guards_kept = kept_by_engine


def lookup_ms(step, steps: int) -> float:
    """ms a step in dynamo's cache lookup (checking the guards), under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key == "TorchDynamo Cache Lookup")
    return us / 1e3 / steps


def measure(precision: str, threads: int, steps: int, rounds: int, llama_cpp: bool) -> dict:
    import llm_peers as peers
    from llm import llama_work

    import model

    torch.set_num_threads(threads)
    lm = model.load("smollm2", device="cpu", precision=precision)
    every, every_guards = compiled_step(lm, every_guard=True)
    inputs, input_guards = compiled_step(lm, every_guard=False)
    steppers = {"eager": peers.stepper(lm), "every guard": peers.stepper(lm, every)}
    steppers["the inputs' guards"] = peers.stepper(lm, inputs)
    # (the compiles, on the first calls)
    best = peers.best_rates(steppers, steps, rounds, threads if llama_cpp else None)
    state = peers.prompt_state(lm)
    return {
        "tokens_per_s": best,
        "guards": {"every guard": len(every_guards), "the inputs' guards": len(input_guards)},
        "lookup_ms": {name: lookup_ms(steppers[name], steps) for name in VARIANTS[1:]},
        "bytes": llama_work(lm, state).bytes,
    }


def section(r: dict) -> str:
    peer = any("llama.cpp" in d["tokens_per_s"] for d in r["rows"])
    lines = [
        SECTION,
        "",
        f"`python bench/compiled_guards.py{' --llama-cpp' if peer else ''}` (`--write` rewrites this section): "
        "the shipped smollm2's batch-1 decode step after section 11's prompt, side by side in one process "
        f"per thread count, each stepper's best median of {r['steps']} steps over {r['rounds']} rounds; "
        + read_limit(r),
        "",
    ]
    columns = [
        "weights",
        "threads",
        "eager, tokens/s",
        "compiled, every guard",
        "compiled, the inputs' guards",
    ]
    columns += [
        "÷ every guard",
        "guards checked, every / inputs'",
        "ms a step checking them, every / inputs'",
    ]
    lines += step_table(columns, peer, "compiled")
    for d in r["rows"]:
        rate, guards, ms = d["tokens_per_s"], d["guards"], d["lookup_ms"]
        ours = rate["the inputs' guards"]
        limit = r["bandwidth"][str(d["threads"])] / d["bytes"]
        cells = [
            d["precision"],
            str(d["threads"]),
            f"{rate['eager']:.1f}",
            f"{rate['every guard']:.1f}",
            f"{ours:.1f}",
            f"{ours / rate['every guard']:.2f}x",
            f"{guards['every guard']:,} / {guards[VARIANTS[2]]:,}",
            f"{ms['every guard']:.2f} / {ms[VARIANTS[2]]:.2f}",
        ]
        if peer:
            cells += [f"{rate['llama.cpp']:.1f}", f"{ours / rate['llama.cpp']:.2f}x"]
        cells += [f"{limit:.1f}", f"{ours / limit:.0%}"]
        lines.append("| " + " | ".join(cells) + " |")
    ratios = [d["tokens_per_s"][VARIANTS[2]] / d["tokens_per_s"]["every guard"] for d in r["rows"]]
    lines += [
        "",
        f"The inputs' guards ÷ every guard: median {statistics.median(ratios):.2f}x over the {len(ratios)} rows. "
        "Both compiled variants run the same graph (one compile, from inductor's cache for the second); what "
        "differs is what dynamo checks before each call. The model's guards go because the engine never changes "
        "the model it serves and a step's graphs are its own (`isolate_recompiles`); every guard on the tokens "
        "and the state stays (tests/app/test_compiler_llama.py). The profiler's lookup time is a little above "
        "the unprofiled one.",
        "",
        LEFT,
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = step_arguments(__doc__)  # (--threads, --precisions, --rounds, --side, --steps, --llama-cpp)
    args = ap.parse_args()
    if args.side:
        precision, threads = args.side.split(",")
        print(
            "RESULT " + json.dumps(measure(precision, int(threads), args.steps, args.rounds, args.llama_cpp))
        )
        return
    flags = ["--steps", str(args.steps), "--rounds", str(args.rounds)] + (
        ["--llama-cpp"] if args.llama_cpp else []
    )
    r = by_thread_count("compiled_guards.py", args, flags)
    publish(SECTION, section(r), r, args.write)


if __name__ == "__main__":
    main()
