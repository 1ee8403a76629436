"""The compiled step's window: grown functionally, or appended in place inside the graph.

A LLaMA decode step adds one key and one value a layer to its window. The eager step writes
them into an arena with spare rows (model/state/arena.py) and reads the window where it
lies. The compiled step grew its state functionally: a `cat` a layer for the attention,
then the 30 layers stacked into the next state, reading and writing the whole window twice
more a step. Now the engine readies each window's arena outside the graph and hands the
graph the arena's layers as tensors of their own, which inductor writes a slice of in place
(`model.compiled_in_place`, app/engine/compiler.py's `_compile`).

This bench measures what that changes on the shipped smollm2's batch-1 decode step, side by
side in one process per thread count: the eager step, the compiled step with its window
grown functionally (the same compile with no axis readied), the compiled step as the engine
builds it, and, with `--llama-cpp`, llama.cpp on the same GGUF with the same threads
(bench/llm_peers.py builds it). Each decodes greedily after section 11's prompt
(bench/llm_peers.py's `stepper`) and again from a state of `--long` tokens, where the window
is four times as long; the steppers alternate over rounds, each one's best median step
counting. The machine's limit, measured in the same run: the bytes a step reads (weights
and window, bench/llm.py's `llama_work`) at the read bandwidth of that many threads
(bench/roofline.py's `read_bandwidth`, best of the run's start and end).

`--write` puts the section "## The compiled step's window" into docs/BENCHMARKS.md. Each
compile takes minutes on 2 cores (inductor's cache shortens the second thread count's).
"""

from __future__ import annotations

import json
import statistics

import torch
from harness import by_thread_count, publish, read_limit, step_arguments, step_table

SECTION = "## The compiled step's window"
FUNCTIONAL, IN_PLACE = "compiled, grown functionally", "compiled, in place"
VARIANTS = ("eager", FUNCTIONAL, IN_PLACE)


def compiled(lm, in_place: bool):
    """`lm`'s compiled step as the engine builds it (`compiler._compile`), its window appended
    in place, or grown functionally: the same compile with no axis readied."""
    from app.engine import compiler

    if in_place:
        return compiler._compile(lm)
    lm.readied_layouts = dict  # (this instance only: a family that names no axis)
    try:
        return compiler._compile(lm)
    finally:
        del lm.readied_layouts


def state_of(lm, tokens: int):
    """One stream's state after `tokens` tokens of a fixed random prompt."""
    ids = torch.randint(0, 40_000, (tokens,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return lm.consume(ids, lm.new_state(1))[1]


def in_place(forward, state) -> bool:
    """Whether two steps of `forward` from `state` leave their windows in one arena."""
    tok = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():
        _, one = forward(tok, state)
        _, two = forward(tok, one)
    arenas = [s.arenas.get("k") for s in (one, two)]
    return None not in arenas and arenas[0].data.data_ptr() == arenas[1].data.data_ptr()


def measure(precision: str, threads: int, steps: int, rounds: int, long: int, llama_cpp: bool) -> dict:
    import llm_peers as peers
    from llm import llama_work

    import model

    torch.set_num_threads(threads)
    lm = model.load("smollm2", device="cpu", precision=precision)
    forwards = {"eager": lambda t, s: lm.forward(t, s, model.IN_PLACE)}
    forwards[FUNCTIONAL], forwards[IN_PLACE] = compiled(lm, False), compiled(lm, True)
    steppers = {name: peers.stepper(lm, f) for name, f in forwards.items()}
    steppers |= {(name, "long"): peers.stepper(lm, f, state_of(lm, long)) for name, f in forwards.items()}
    # (the compiles, on the first calls)
    best = peers.best_rates(steppers, steps, rounds, threads if llama_cpp else None)
    state = peers.prompt_state(lm)
    far = state_of(lm, long)
    return {
        "appends_in_place": {name: in_place(forwards[name], far) for name in VARIANTS[1:]},
        "tokens_per_s": {k: v for k, v in best.items() if isinstance(k, str)},
        "long_tokens_per_s": {k[0]: v for k, v in best.items() if isinstance(k, tuple)},
        "bytes": llama_work(lm, state).bytes,
        "long_bytes": llama_work(lm, far).bytes,
        "tokens": int(state.n_tokens[0]),
    }


def section(r: dict) -> str:
    peer = any("llama.cpp" in d["tokens_per_s"] for d in r["rows"])
    lines = [
        SECTION,
        "",
        f"`python bench/compiled_window.py{' --llama-cpp' if peer else ''}` (`--write` rewrites this section): "
        f"the shipped smollm2's batch-1 decode step after section 11's prompt ({r['rows'][0]['tokens']} tokens) "
        f"and from a state of {r['long']} tokens, side by side in one process per thread count, each stepper's "
        f"best median of {r['steps']} steps over {r['rounds']} rounds; " + read_limit(r),
        "",
    ]
    columns = [
        "weights",
        "threads",
        "state",
        "eager, tokens/s",
        FUNCTIONAL,
        IN_PLACE,
        "in place ÷ functionally",
    ]
    lines += step_table(columns, peer, "in place")
    for d in r["rows"]:
        for state, rate, nbytes in (
            (f"{d['tokens']} tokens", d["tokens_per_s"], d["bytes"]),
            (f"{r['long']} tokens", d["long_tokens_per_s"], d["long_bytes"]),
        ):
            ours, limit = rate[IN_PLACE], r["bandwidth"][str(d["threads"])] / nbytes
            cells = [d["precision"], str(d["threads"]), state]
            cells += [f"{rate[v]:.1f}" for v in VARIANTS] + [f"{ours / rate[FUNCTIONAL]:.2f}x"]
            if peer:  # (llama.cpp decodes after section 11's prompt only)
                theirs = d["tokens_per_s"]["llama.cpp"]
                cells += [f"{theirs:.1f}", f"{ours / theirs:.2f}x"] if rate is d["tokens_per_s"] else ["", ""]
            cells += [f"{limit:.1f}", f"{ours / limit:.0%}"]
            lines.append("| " + " | ".join(cells) + " |")
    ratios = [
        d[k][IN_PLACE] / d[k][FUNCTIONAL] for d in r["rows"] for k in ("tokens_per_s", "long_tokens_per_s")
    ]
    lines += [
        "",
        f"In place ÷ grown functionally: median {statistics.median(ratios):.2f}x over the {len(ratios)} rows. "
        "Both compiled steps trace the same forward with the same options (the in-place one also checks guards on "
        "the arena's layers it is handed); what differs is where "
        "the window's new rows go: into a new tensor a layer and then a stack of all 30 (functionally), or "
        "into the arena's spare rows (in place: each arena readied outside the graph, `model.compiled_in_place`, "
        "its layers handed in as tensors of their own, which inductor writes a slice of without copying the "
        "rest; an arena is copied only when its spare rows run out, every 64 steps). The gain grows with the "
        "window, which the functional step copied twice a step.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = step_arguments(__doc__)  # (--threads, --precisions, --rounds, --side, --steps, --llama-cpp)
    ap.add_argument("--long", type=int, default=640, help="tokens in the long state (the window: 1,024)")
    args = ap.parse_args()
    if args.side:
        precision, threads = args.side.split(",")
        figures = measure(precision, int(threads), args.steps, args.rounds, args.long, args.llama_cpp)
        print("RESULT " + json.dumps(figures))
        return
    flags = ["--steps", str(args.steps), "--rounds", str(args.rounds), "--long", str(args.long)]
    flags += ["--llama-cpp"] if args.llama_cpp else []
    r = by_thread_count("compiled_window.py", args, flags, long=args.long)
    publish(SECTION, section(r), r, args.write)


if __name__ == "__main__":
    main()
