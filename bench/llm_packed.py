"""The shipped assistant (smollm2, its GGUF Q4_1 file) in each weight precision, side by side
in one run (issue 42): fp32 (the file dequantized), int8 and int4 (packed weights, bfloat16
activations into torch's weight-only kernels: model/int8.py, model/int4.py).

Per precision:
  * batch-1 decode tokens/s at 1 and 2 threads: the step the engine runs (next_logits, pick,
    forward), after a 600-character prompt, eager and as a server with `--compile` serves it
    (`served`: the engine's `DecodeStep`, whose background probe is run to its end first at
    that thread count; compiled where it adopted the compiled step, else eager); the sides
    alternate for `--rounds` rounds and each keeps its best median (a shared machine's load
    then falls on all alike). With `--llama-cpp`, llama.cpp's own step on the same file joins
    them (bench/llm_peers.py's build in .bench-peers/, which `make bench-peers` makes);
  * weight bytes a decode step reads (every block matrix and the head once; the token
    lookup reads one row) over the file's bytes: the issue's target is <= 1.2;
  * greedy agreement with fp32 on the same file (`agreement`): `--prompts` prompts of 32
    tokens from the held-out corpus, `--tokens` greedy tokens each. Each path running
    freely: the share of tokens identical position by position (a divergence counts every
    token after it as different) and the share of prompts identical throughout; and
    teacher-forced on fp32's tokens: the share of positions where the path picks fp32's
    token from fp32's history (a flip counts once). With `--llama-cpp`, llama.cpp's own
    picks on the same file and prompts too: how far the peer itself is from the bound.

Ratios, not times, are the result; no test asserts a time. Usage:
    python bench/llm_packed.py [--threads 1,2] [--prompts 50 --tokens 128] [--llama-cpp] [--no-compile] [--write]
(`--threads ""` measures the agreement alone, and prints the section without writing it.)
`--write` puts the section "## Packed weights: fp32, int8, int4" into docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import numpy as np
import torch
from harness import arguments, publish
from llm_peers import llama_cpp, llama_cpp_stepper, rate, stepper

import model
from app.engine.compiler import DecodeStep
from model import LanguageModel
from model.corpus import load_split
from model.int4 import Int4Linear
from model.int8 import Int8Linear

SECTION = "## Packed weights: fp32, int8, int4"
PRECISIONS = ("fp32", "int8", "int4")
PROMPT_TOKENS, BATCH = 32, 16  # agreement: prompts of 32 tokens, 16 rows a batch (the decode kernels' regime)


@functools.cache
def loaded(precision: str) -> LanguageModel:
    return model.load("smollm2", device="cpu", precision=precision)


def weight_bytes(lm: LanguageModel) -> int:
    """Bytes of weights one decode step reads: every linear layer once (the head included)."""
    total = 0
    for m in lm.modules():
        if isinstance(m, (Int4Linear, Int8Linear)):
            total += m.weight_bytes()
        elif isinstance(m, torch.nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
    return total


def served(precision: str) -> DecodeStep:
    """The engine's decode step for batch 1 with `--compile`, at this thread count: its
    background probe (compile, check, time against eager) run to its end here."""
    step = DecodeStep(loaded(precision), compile=True, max_rows=1)
    step.start()
    assert step._thread is not None
    step._thread.join()
    print(f"{precision}, {torch.get_num_threads()} thread(s): {step.status}", flush=True)
    return step


def decode_rates(
    threads: int, steps: int, rounds: int, llama_cpp: bool, compile: bool
) -> tuple[dict[str, float], dict[str, bool]]:
    """Tokens/s of each side, and for each precision whether the served step is compiled."""
    torch.set_num_threads(threads)
    steppers = {p: stepper(loaded(p)) for p in PRECISIONS}
    adopted = {}
    for p in PRECISIONS if compile else ():
        step = served(p)
        adopted[p] = step.serves_compiled(1)
        steppers[f"{p} served"] = stepper(loaded(p), step)
    if llama_cpp:
        steppers["llama.cpp"] = llama_cpp_stepper(model.checkpoint.resolve("smollm2"), threads)
    for step in steppers.values():
        for _ in range(5):  # warm-up
            step()
    best = dict.fromkeys(steppers, 0.0)
    for _ in range(rounds):
        for name, step in steppers.items():
            best[name] = max(best[name], rate(step, steps))
    return best, adopted


def prompts(n: int) -> torch.Tensor:
    """(n, PROMPT_TOKENS) token ids from the held-out corpus, each from its own place."""
    tok = loaded("fp32").tokenizer
    assert tok is not None
    text = load_split("shakespeare", "valid")[1][1]
    rows = [tok.encode(text[5_000 + 900 * i : 5_000 + 900 * i + 600])[:PROMPT_TOKENS] for i in range(n)]
    return torch.tensor(rows)


@torch.no_grad()
def greedy(
    lm: LanguageModel, prompt: torch.Tensor, tokens: int, forced: torch.Tensor | None = None
) -> torch.Tensor:
    """(B, tokens) greedy continuations of a batch of prompts. With `forced` (B, tokens),
    teacher forcing: each step is fed forced's token, and what comes back is the token the
    path would have picked there."""
    _, state = lm(prompt)
    out = []
    for i in range(tokens):
        nxt = lm.next_logits(state).argmax(-1, keepdim=True)
        out.append(nxt)
        _, state = lm(nxt if forced is None else forced[:, i : i + 1], state)
    return torch.cat(out, 1)


def batched(
    lm: LanguageModel, rows: torch.Tensor, tokens: int, forced: torch.Tensor | None = None
) -> torch.Tensor:
    """`greedy` over `rows` in batches of BATCH."""
    parts = range(0, len(rows), BATCH)
    return torch.cat(
        [
            greedy(lm, rows[i : i + BATCH], tokens, None if forced is None else forced[i : i + BATCH])
            for i in parts
        ]
    )


@functools.cache
def reference(n: int, tokens: int) -> torch.Tensor:
    """fp32's greedy continuations of the `n` prompts: what every path is held to."""
    return batched(loaded("fp32"), prompts(n), tokens)


def shares(picks: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """The share of tokens identical to `ref`'s, position by position, and of rows identical
    throughout."""
    same = picks == ref
    return float(same.float().mean()), float(same.all(-1).float().mean())


def agreement(
    precision: str, prompts: int = 50, tokens: int = 128, detail: bool = False, forced: bool = False
):
    """The share of greedy tokens identical to fp32's, position by position, over `prompts`
    prompts x `tokens` tokens, each path running freely (a divergence counts every token
    after it as different); with `detail`, also the share of prompts identical throughout.
    `forced`: teacher-forced on fp32's tokens instead, so that each position asks only
    whether the path picks fp32's token from fp32's history (a flip counts once)."""
    ref = reference(prompts, tokens)
    picks = batched(loaded(precision), globals()["prompts"](prompts), tokens, ref if forced else None)
    share, whole = shares(picks, ref)
    return (share, whole) if detail else share


def llama_cpp_picks(
    rows: torch.Tensor, tokens: int, forced: torch.Tensor | None, threads: int
) -> torch.Tensor:
    """llama.cpp's own greedy picks on the same file and the same prompts (its Q4_1 products
    with 8-bit activations, as it serves): free-running, or teacher-forced on `forced`."""
    llm = llama_cpp(model.checkpoint.resolve("smollm2"), threads)
    from llama_cpp import llama_get_logits_ith  # (importable once `llama_cpp` has put its build on the path)

    out = []
    for b, row in enumerate(rows.tolist()):
        llm.reset()
        llm.eval(row)
        picks = []
        for i in range(tokens):
            # the last evaluated position's logits (llama-cpp-python keeps `scores` only with logits_all)
            logits = np.ctypeslib.as_array(llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
            picks.append(int(np.argmax(logits)))
            llm.eval([picks[-1] if forced is None else int(forced[b, i])])
        out.append(picks)
    return torch.tensor(out)


def agreements(paths: list[str], n: int, tokens: int, threads: int) -> dict:
    """Each path's agreement with fp32, free-running (tokens, prompts) and teacher-forced
    (tokens): recur's precisions, and "llama.cpp" for the peer's own."""
    ref, rows = reference(n, tokens), prompts(n)
    out: dict = {"prompts": n, "tokens": tokens}
    for p in paths:
        if p == "llama.cpp":
            free, forced = (llama_cpp_picks(rows, tokens, f, threads) for f in (None, ref))
            out[p] = (*shares(free, ref), shares(forced, ref)[0])
        else:
            out[p] = (*agreement(p, n, tokens, detail=True), agreement(p, n, tokens, forced=True))
        print(f"agreement {p} (free, prompts, forced): {out[p]}", flush=True)
    return out


def section(r: dict) -> str:
    first = next(iter(r["decode"].values()), {})  # (none: `--threads ""`, agreement alone)
    cols = [c for p in PRECISIONS for c in (p, f"{p} served") if c in first]
    cols += ["llama.cpp"] if "llama.cpp" in first else []
    head = [c.replace(" served", ", served") for c in cols]
    lines = [
        SECTION,
        "",
        f"`python bench/llm_packed.py` on a {r['cpus']}-core machine shared with other jobs: the shipped "
        f"SmolLM2-135M-Instruct Q4_1 file ({r['file_bytes'] / 1e6:.1f} MB) in each weight precision, decode "
        f"alternating the sides for {r['rounds']} rounds (each side's best median step). Each precision eager, "
        "and served as `recur serve --compile` serves it (the engine's `DecodeStep` after its probe at that "
        "thread count: **compiled** where the probe adopted the compiled step, else eager).",
        "",
    ]
    if first:
        lines += [
            "| batch-1 decode, tokens/s | "
            + " | ".join(head)
            + " | int4 / fp32 |"
            + (" int4 served / llama.cpp |" if "llama.cpp" in cols else ""),
            "|---" * (len(cols) + 2 + ("llama.cpp" in cols)) + "|",
        ]
    for threads, row in r["decode"].items():
        marks = r["adopted"].get(threads, {})
        cells = " | ".join(
            f"{row[c]:.1f}"
            + (" (compiled)" if marks.get(c.removesuffix(" served")) and c.endswith("served") else "")
            for c in cols
        )
        int4 = row.get("int4 served", row["int4"])
        vs = f" {int4 / row['llama.cpp']:.2f}x |" if "llama.cpp" in row else ""
        lines.append(
            f"| {threads} thread(s) | {cells} | {int4 / row.get('fp32 served', row['fp32']):.2f}x |{vs}"
        )
    lines += [
        "",
        "| | fp32 | int8 | int4 |",
        "|---|---|---|---|",
        "| weight bytes a decode step reads, MB | "
        + " | ".join(f"{r['weight_bytes'][p] / 1e6:.1f}" for p in PRECISIONS)
        + " |",
        "| ÷ the file's bytes (target <= 1.2) | "
        + " | ".join(f"{r['weight_bytes'][p] / r['file_bytes']:.2f}" for p in PRECISIONS)
        + " |",
    ]
    lines += ["", *agreement_table(r["agreement"])]
    lines += ["", "Reproduce: `python bench/llm_packed.py --write`.", ""]
    return "\n".join(lines)


def agreement_table(a: dict) -> list[str]:
    """Each path's shares (`agreements`) as a table, a row per measure."""
    paths = [p for p in ("int8", "int4", "llama.cpp") if p in a]
    lines = [
        f"| greedy tokens identical to fp32's ({a['prompts']} prompts x {a['tokens']} tokens; target >= 95%) | "
        + " | ".join(paths)
        + " |",
        "|---" * (len(paths) + 1) + "|",
    ]
    measures = (
        "free-running, position by position",
        "prompts identical throughout",
        "teacher-forced on fp32's tokens",
    )
    for i, what in enumerate(measures):
        lines.append(f"| {what} | " + " | ".join(f"{a[p][i]:.3f}" for p in paths) + " |")
    return lines


def main() -> None:
    ap = arguments(__doc__)
    ap.add_argument("--threads", default="1,2", help="comma list of thread counts")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per side and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--llama-cpp", action="store_true", help="llama.cpp's step too (.bench-peers/ build)")
    ap.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also each precision as `recur serve --compile` serves it (a compile per precision and thread count)",
    )
    args = ap.parse_args()
    if args.write and not args.threads:
        ap.error(
            '--write rewrites the whole section, decode figures included: --threads "" measures agreement only'
        )
    path = model.checkpoint.resolve("smollm2")
    r: dict = {"cpus": os.cpu_count(), "rounds": args.rounds, "file_bytes": path.stat().st_size}
    r["weight_bytes"] = {p: weight_bytes(loaded(p)) for p in PRECISIONS}
    print(f"weight bytes: {json.dumps(r['weight_bytes'])} (file {r['file_bytes']})", flush=True)
    r["decode"], r["adopted"] = {}, {}
    for t in (int(x) for x in args.threads.split(",") if x):
        r["decode"][t], r["adopted"][t] = decode_rates(
            t, args.steps, args.rounds, args.llama_cpp, args.compile
        )
        print(f"decode tokens/s, {t} thread(s): {json.dumps(r['decode'][t])}", flush=True)
    threads = min(2, os.cpu_count() or 1)
    torch.set_num_threads(threads)
    paths = ["int8", "int4"] + (["llama.cpp"] if args.llama_cpp else [])
    r["agreement"] = agreements(paths, args.prompts, args.tokens, threads)
    publish(SECTION, section(r), r, args.write)


if __name__ == "__main__":
    main()
