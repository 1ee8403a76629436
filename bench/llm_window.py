"""What the window costs a decode step, eager and compiled (issue 42): is appending it in
place inside the compiled graph worth building?

The eager step appends each new key and value into its arena in place and reads the window
where it lies (model/state/arena.py). The compiled step grows the state functionally: a
`cat` per layer for the attention, then the stack the next state holds, so it reads and
writes the window twice more. What that costs shows in how a step's time grows with the
window: smollm2 at one precision, batch 1, the same thread count, a state of `--short`
then `--long` tokens, each step timed eager and compiled (the step the engine's
`DecodeStep` compiles in its background probe, timed whether or not the probe adopted it:
the question is what its graph costs), the variants alternating over
`--rounds` rounds (each one's best median step). Per extra window row, against the time one
read of its keys and values takes at the read bandwidth measured in the same run:

    extra ms per row / (bytes of a row's keys and values / read bandwidth)

An eager step reads its window once (near 1); each copy adds about two more (a read and a
write). The share of the long step the copies take is the compiled step's growth beyond
the eager step's, over the long step: the most an in-place append in the graph could save.

Run: `python bench/llm_window.py` (compiles one precision: minutes on 2 cores, less with
inductor's cache warm).
"""

from __future__ import annotations

import argparse

import torch
from llm_packed import loaded, served
from llm_peers import rate
from roofline import read_bandwidth

import model


def state_of(lm: model.LanguageModel, tokens: int) -> model.State:
    """One stream's state after `tokens` tokens of a fixed random prompt."""
    ids = torch.randint(0, 40_000, (tokens,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return lm.consume(ids, lm.new_state(1))[1]


def stepper(forward, state: model.State):
    """A batch-1 decode from `state` by `forward`, each call one step on from the last (as
    served: each step's state feeds the next, so the eager step appends in place and the
    compiled one gets the plain tensors its last call returned); the window grows by the
    steps timed, some 50 rows, alike for every variant."""
    box = {"state": state, "tok": torch.zeros(1, 1, dtype=torch.long)}

    @torch.no_grad()
    def step() -> None:
        _, box["state"] = forward(box["tok"], box["state"])

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precision", default="int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--short", type=int, default=150)
    ap.add_argument("--long", type=int, default=900)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    bandwidth = read_bandwidth(args.threads)
    lm = loaded(args.precision)
    torch.set_num_threads(args.threads)
    served_step = served(args.precision)
    adopted = served_step.serves_compiled(1)
    # the compiled step itself, whatever the probe decided: the question is what its graph costs
    compiled = served_step._compiled
    assert compiled is not None, served_step.status.error
    cfg = lm.config
    row_bytes = 2 * cfg.n_layer * cfg.n_kv_head * cfg.head_dim * 4  # a position's keys and values, fp32
    states = {n: state_of(lm, n) for n in (args.short, args.long)}
    eager = lambda t, s: lm.forward(t, s, model.IN_PLACE)  # noqa: E731
    steps = {}
    for n, st in states.items():  # the compiled step starts from plain tensors, as its own steps leave them
        steps["eager", n] = stepper(eager, st)
        steps["compiled", n] = stepper(compiled, st.plain())
    for step in steps.values():
        step()  # warm-up
    best = dict.fromkeys(steps, 0.0)
    for _ in range(args.rounds):
        for key, step in steps.items():
            best[key] = max(best[key], rate(step, args.steps))
    ms = {key: 1e3 / r for key, r in best.items()}
    one_read = row_bytes / bandwidth * 1e3  # ms to read a row once
    rows = args.long - args.short
    print(
        f"smollm2 {args.precision}, batch 1, {args.threads} thread(s); read bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s; a row's keys and values {row_bytes / 1e3:.1f} kB"
    )
    print(
        f"| step | ms at {args.short} tokens | ms at {args.long} tokens | ms per extra row | ÷ one read of it |"
    )
    print("|---|---|---|---|---|")
    growth = {}
    for name in ("eager", "compiled"):
        a, b = ms[(name, args.short)], ms[(name, args.long)]
        growth[name] = (b - a) / rows
        label = (
            name if name == "eager" else f"compiled ({'adopted' if adopted else 'not adopted'} by the probe)"
        )
        print(
            f"| {label} | {a:.2f} | {b:.2f} | {growth[name] * 1e3:.2f} µs | {growth[name] / one_read:.1f}x |"
        )
    extra = (growth["compiled"] - growth["eager"]) * args.long
    print(
        f"the compiled step's window costs beyond the eager step's at {args.long} tokens: {extra:.2f} ms, "
        f"{extra / ms[('compiled', args.long)]:.0%} of its step; at {args.short}: "
        f"{(growth['compiled'] - growth['eager']) * args.short / ms[('compiled', args.short)]:.0%}"
    )


if __name__ == "__main__":
    main()
