"""The per-step cost of a grammar-constrained row (tools, response formats), side by side.

Three batches of the same size decode in one run, their steps interleaved so that the
machine's noise falls on all three alike, each through the engine's own `Runner.decode`
(the real model's forward, the batched sampler, detokenising): no row constrained; one row
constrained; every row constrained (each batch first in its round in turn). The constraint is a JSON schema (an array of at least
100 integers, so that no constrained row ends before the run does), compiled with
llguidance as a request's `response_format` is (model/grammar.py). Printed per batch: the
median step, its ratio to the unconstrained batch, and the engine thread's time in the
grammar masks (computing them, in llguidance's threads, and applying them) per step: the
cost itself, which the step ratio (noisier on a shared machine) bounds.

Usage: python bench/grammar_step.py [--model smollm2] [--rows 4] [--steps 40] [--device cpu]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import torch

from app.engine.compiler import DecodeStep
from app.engine.requests import Outbox, Request
from app.engine.runner import Row, Runner
from model.checkpoint import load
from model.grammar import Grammar, Grammars

SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 100}


def batch(
    runner: Runner, prompt: list[int], rows: int, constrained: int, grammars: Grammars, steps: int
) -> list[Row]:
    loop = asyncio.new_event_loop()  # (the requests' events go nowhere: nobody reads them)
    matcher = grammars.matcher(Grammar.json_schema(SCHEMA))
    out = []
    for i in range(rows):
        req = Request(None, list(prompt), max_tokens=steps + 10, seed=i, loop=loop)
        req.grammar = matcher.fork() if i < constrained else None
        out.append(runner.load(req))
    runner.prefill(out, len(prompt))
    return out


@torch.no_grad()
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    torch.set_num_threads(1)
    lm = load(args.model, device=args.device)
    assert lm.tokenizer is not None
    grammars = Grammars(lm.tokenizer)
    prompt = lm.tokenizer.encode("Some numbers:")
    configs = {"none": 0, "one": 1, "all": args.rows}
    runners, rows = {}, {}
    for name, constrained in configs.items():
        runners[name] = Runner(lm, lm.tokenizer, DecodeStep(lm, False, max_rows=args.rows), Outbox())
        rows[name] = batch(runners[name], prompt, args.rows, constrained, grammars, args.steps)
    times: dict[str, list[float]] = {name: [] for name in configs}
    names = list(configs)
    for step in range(args.steps + 3):
        for name in names[step % 3 :] + names[: step % 3]:  # (each batch first in turn)
            t0 = time.perf_counter()
            runners[name].decode(rows[name])
            if lm.device.type == "cuda":
                torch.cuda.synchronize()
            if step >= 3:  # (warm-up)
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["none"])
    results = {}
    print(f"{args.model}, {args.rows} rows a step, {args.steps} steps each, {lm.device.type}")
    print(f"{'constrained rows':>18} {'step ms':>9} {'ratio':>7} {'mask ms/step':>13} {'mask ms/row':>12}")
    for name, constrained in configs.items():
        c = runners[name].counters
        med = statistics.median(times[name])
        mask = c.grammar_seconds / c.decode_steps if constrained else 0.0
        per_row = c.grammar_seconds / c.grammar_rows if constrained else 0.0
        assert all(r.finish_reason is None for r in rows[name]), "a row ended before the run did"
        results[name] = {"constrained": constrained, "step_ms": med * 1e3, "ratio": med / base,
                         "mask_ms_per_step": mask * 1e3, "mask_ms_per_row": per_row * 1e3}  # fmt: skip
        print(
            f"{constrained:>18} {med * 1e3:>9.2f} {med / base:>7.3f} {mask * 1e3:>13.3f} {per_row * 1e3:>12.3f}"
        )
    text = lm.tokenizer.decode(rows["one"][0].ids)
    assert text.startswith("["), text  # (the constrained row is JSON so far)
    if args.json:
        args.json.write_text(
            json.dumps({"model": args.model, "rows": args.rows, "results": results}, indent=1)
        )


if __name__ == "__main__":
    main()
