"""A burst of requests into the engine: how its scheduler consumes their prompts.

16 requests (bench/llm_peers.py's 16 prompts, 108 to 154 tokens each) are submitted 5 ms
apart into the server's own engine (`app.assembly.build_engine` with the default settings
but the batch of 16), in-process: no HTTP, no Redis. The shipped smollm2, greedy, 128 tokens
each: `make bench-peers`'s 16 x 128. Every engine step is timed, its prefill forwards (rows x
chunk length) and its decode step apart.

Two schedulers side by side, each in a process of its own with its app/ and model/ first on
the path, alternating over rounds, each side's best round kept: today's, and commit BASE's,
before a burst's prompts took the prefill budget per waiting row (app/engine/prefill.py):
there the 15 prompts waiting beside the first decoding row shared one prompt's budget, one
row's 32-token chunk a step. The machine's limit for this load is
measured in the same run: recur's prompt rate (a 512-token prompt) and its 16-row step alone,
put together as a server that lost nothing between them would run (`serial_bound`, as
section 11 does).

`--write` puts the section "## A burst of prompts" into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time

import torch
from harness import arguments, beside, model_at, publish

SECTION = "## A burst of prompts"
BASE = "b1b9133"  # the commit before the budget per waiting row (c32e1d9)
GAP_S = 0.005  # between two requests' arrivals


def measure(precision: str, threads: int) -> dict:
    """One burst through this process's engine: its figures and its steps."""
    import llm_peers as peers

    import model
    from app.assembly import build_engine
    from app.config import Settings
    from app.engine import Request
    from model.sampling import SamplingParams

    lm = model.load("smollm2", device="cpu", precision=precision)
    assert lm.tokenizer is not None
    settings = Settings(cpu_threads=threads, max_batch_size=peers.STREAMS, compile=False)
    engine = build_engine(settings, lm, "smollm2")
    steps = timed_steps(engine)
    prompts = [lm.tokenizer.encode(p) for p in peers.prompts()]

    async def burst() -> tuple[float, list[float]]:
        engine.start()
        try:

            async def one(ids: list[int]) -> float:
                t0 = time.perf_counter()
                req = engine.submit(
                    Request(None, ids, SamplingParams(temperature=0.0), None, peers.NEW_TOKENS, [])
                )
                await req.events.get()  # its first token
                first = time.perf_counter() - t0
                await req.finished()
                return first

            t0 = time.perf_counter()
            tasks = []
            for ids in prompts:
                tasks.append(asyncio.create_task(one(ids)))
                await asyncio.sleep(GAP_S)
            firsts = await asyncio.gather(*tasks)
            return time.perf_counter() - t0, list(firsts)
        finally:
            engine.stop()

    wall, firsts = asyncio.run(burst())
    return summary(steps, wall, firsts, sum(len(p) for p in prompts), peers.STREAMS * peers.NEW_TOKENS)


def timed_steps(engine) -> list[list[tuple]]:
    """Per engine step: ("p", rows, chunk length, seconds) for each prefill forward and
    ("d", rows, seconds) for the decode step (the runner's own calls, wrapped)."""
    steps: list[list[tuple]] = []
    step, prefill, decode = engine._step, engine.runner.prefill, engine.runner.decode

    def stepping(admitted):
        steps.append([])
        step(admitted)

    def prefilling(rows, size):
        t0 = time.perf_counter()
        prefill(rows, size)
        steps[-1].append(("p", len(rows), size, time.perf_counter() - t0))

    def decoding(rows):
        t0 = time.perf_counter()
        decode(rows)
        steps[-1].append(("d", len(rows), time.perf_counter() - t0))

    engine._step, engine.runner.prefill, engine.runner.decode = stepping, prefilling, decoding
    return steps


def summary(
    steps: list[list[tuple]], wall: float, firsts: list[float], prompt_tokens: int, made: int
) -> dict:
    forwards = [w for s in steps for w in s if w[0] == "p"]
    decodes = [w for s in steps for w in s if w[0] == "d"]
    full = next(  # (never: counted as the last step)
        (i for i, s in enumerate(steps) if any(w[0] == "d" and w[1] == len(firsts) for w in s)), len(steps)
    )
    return {
        "tokens_per_s": made / wall,
        "prompt_tokens": prompt_tokens,
        "prefill_forwards": len(forwards),
        "prefill_s": sum(w[3] for w in forwards),
        "decode_steps": len(decodes),
        "decode_s": sum(w[2] for w in decodes),
        "rows_per_decode_step": sum(w[1] for w in decodes) / len(decodes),
        "first_full_step": full,
        "ttft_p50_s": statistics.median(firsts),
        "ttft_max_s": max(firsts),
        "longest_step_s": max(sum(w[-1] for w in s) for s in steps),
    }


def limits(precision: str, threads: int, prompt_tokens: int) -> dict:
    """recur's prompt rate and 16-row step alone, and the bound they make for this load."""
    import llm_peers as peers

    torch.set_num_threads(threads)
    prompt = peers.recur_prompt(precision, threads, peers.prompt_ids())
    prompt()  # warm-up
    prompt_rate = peers.PROMPT_TOKENS * max(peers.rate(prompt, 3) for _ in range(3))
    step_rate = peers.model_streams(precision, threads)
    made = peers.STREAMS * peers.NEW_TOKENS
    bound = made / (prompt_tokens / prompt_rate + made / step_rate)
    return {"prompt_tokens_per_s": prompt_rate, "step_tokens_per_s": step_rate, "bound_tokens_per_s": bound}


ROWS = (  # (label, key, format, whether more is better)
    ("aggregate tokens/s", "tokens_per_s", "{:.1f}", True),
    ("prefill forwards", "prefill_forwards", "{:d}", False),
    ("seconds in prefill forwards", "prefill_s", "{:.2f}", False),
    ("decode steps", "decode_steps", "{:d}", False),
    ("seconds in decode steps", "decode_s", "{:.2f}", False),
    ("rows per decode step", "rows_per_decode_step", "{:.1f}", True),
    ("first step with all 16 rows decoding", "first_full_step", "{:d}", False),
    ("time to first token, median (s)", "ttft_p50_s", "{:.2f}", False),
    ("time to first token, last (s)", "ttft_max_s", "{:.2f}", False),
    ("longest step: a decoding row's longest gap (s)", "longest_step_s", "{:.2f}", False),
)


def section(r: dict) -> str:
    base, today, lim = r["base"], r["today"], r["limits"]
    lines = [
        SECTION,
        "",
        f"`python bench/burst.py` (`--write` rewrites this section): {r['streams']} requests of 128 tokens, "
        f"their prompts {today['prompt_tokens']:,} tokens together, submitted {GAP_S * 1000:.0f} ms apart "
        f"into the server's engine in-process (no HTTP, no Redis), smollm2 {r['precision']}, greedy, "
        f"{r['threads']} threads, on a {r['cpus']}-core machine (load average {r['load'][0]:.1f} at the start, "
        f"{r['load'][1]:.1f} at the end). Two schedulers alternating over {r['rounds']} rounds, each in a "
        f"process of its own, each one's best round: commit {BASE}'s, where the prompts waiting beside a "
        "decoding row shared one prompt's budget a step (`--prefill-tokens-per-step`, 32), and today's, where a "
        "step takes that budget for each row waiting on its prompt per decoding row, up to one segment (256 "
        "tokens), in equal chunks (`PrefillBudget`, app/engine/prefill.py).",
        "",
        f"| | one prompt's budget ({BASE}) | per waiting row (today) | today ÷ before |",
        "|---|---|---|---|",
    ]
    for label, key, fmt, more in ROWS:
        ratio = today[key] / base[key] if base[key] else float("nan")
        lines.append(
            f"| {label} | {fmt.format(base[key])} | {fmt.format(today[key])} | {ratio:.2f}x"
            + (" (more is better) |" if more else " |")
        )
    lines += [
        "",
        f"The machine's limit for this load, measured in the same run: recur's prompt rate "
        f"{lim['prompt_tokens_per_s']:.1f} tokens/s (a 512-token prompt) and its {r['streams']}-row step alone "
        f"{lim['step_tokens_per_s']:.1f} tokens/s, together (the prompts first, then full steps, nothing lost "
        f"between them) {lim['bound_tokens_per_s']:.1f} tokens/s: the engine reaches "
        f"{today['tokens_per_s'] / lim['bound_tokens_per_s']:.0%} of it today, "
        f"{base['tokens_per_s'] / lim['bound_tokens_per_s']:.0%} before. The same load over HTTP against "
        "llama-server: section 11.",
        "",
        "The price is the longest gap a decoding row sees: "
        f"{base['longest_step_s']:.2f} s before, {today['longest_step_s']:.2f} s today, while the burst's rows "
        "still outnumber the decoding ones. Before, it was the first step (one whole prompt, nothing else "
        "decoding); today it is the step that consumes the prompts' remainders, each of its own length, in a "
        "forward of its own (ragged rows in one forward would make them one). A long prompt arriving among "
        "decoding streams (one row waiting, several decoding) is consumed at the budget itself, as before "
        "(section 12's gaps).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    import llm_peers as peers

    ap = arguments(__doc__)
    ap.add_argument("--precision", default="int4", choices=peers.PRECISIONS)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--side", action="store_true", help="one burst through this process's engine (internal)")
    args = ap.parse_args()
    if args.side:
        print("RESULT " + json.dumps(measure(args.precision, args.threads)))
        return
    flags = ["--side", "--precision", args.precision, "--threads", str(args.threads)]
    r: dict = {"precision": args.precision, "threads": args.threads, "cpus": os.cpu_count()}
    r.update(streams=peers.STREAMS, rounds=args.rounds, load=[os.getloadavg()[0]])
    with model_at(BASE, ("app", "model")) as tree:
        if tree is None:
            raise SystemExit(f"git cannot give commit {BASE}'s tree")
        r.update(beside("burst.py", tree, flags, args.rounds))
    r["limits"] = limits(args.precision, args.threads, r["today"]["prompt_tokens"])
    r["load"].append(os.getloadavg()[0])
    publish(SECTION, section(r), r, args.write)


if __name__ == "__main__":
    main()
