"""The shipped assistant (smollm2, SmolLM2-135M-Instruct) against the machine's limits:
decode at batch 1, 16 and 64 and prefill at 2,048 tokens, with its weights in fp32, int8
and int4 (`--precision int8|int4`, model/int8.py, model/int4.py), side by side in one run;
and what batching buys, issue 42's "16 streams ÷ 1 stream" (target >= 6x at 512 tokens of
history each, and at a full window with the bytes a step reads): batch 1 and 16 after
`--history` tokens, beside the full window's rows.

bench/roofline.py's machinery does the work: the machine's limits (`Machine`: read
bandwidth, GEMM rate, sampled before each model and at the end), the step the server runs
(`decode`: next_logits, pick, forward; median of timed steps, a profile of where the time
goes), prefill (`prefill`, best of 3) and the fractions of each roofline (`against`). What
this script adds is what a step of this family must do (`llama_work`):

  bytes   every weight matrix once (fp32: 4 bytes a weight; int8: 1, plus a 4-byte scale a
          row; int4: half a byte, plus a scale and a zero a group of 32), the embedding only
          as the (tied) head, + the keys and values attended:
          2·B·L·K·kvh·hd in the state's dtype, K = S + W + 1 (sinks, window, the new token)
  FLOPs   2·B·(every weight matrix's multiply-adds + attention's 2·L·H·hd·K)

1 torch thread, as every roofline figure in docs/BENCHMARKS.md. The state is filled to the
window before timing (the steady state of a long session). `--write` puts the section
"## 9. The assistant: decode and prefill" into docs/BENCHMARKS.md; `make bench` does.
The engine's compiled step (app/engine/compiler.py) is left out unless `--compiled`: for
a 30-layer model its background compile takes tens of minutes on this machine, during
which the server runs the eager step measured here.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from harness import model_at, run, write_section
from roofline import WORK, Machine, Work, against, decode, prefill, served_step
from torch.profiler import profile

import model
from model import LanguageModel, State
from model.int4 import Int4Linear
from model.int8 import Int8Linear

SECTION = "## 9. The assistant: decode and prefill"


def llama_work(lm: LanguageModel, state: State) -> Work:
    c = lm.config
    B, L = state.batch_size, c.n_layer
    K = state["sink_k"].shape[2] + state["k"].shape[2] + 1
    kv = 2 * B * L * K * c.n_kv_head * c.head_dim * state["k"].element_size()
    weights, macs = 0, 0
    for m in lm.modules():
        if isinstance(m, torch.nn.Linear):
            weights += m.weight.numel() * m.weight.element_size()
            macs += m.weight.numel()
        elif isinstance(m, (Int8Linear, Int4Linear)):
            weights += m.weight_bytes()
            macs += m.in_features * m.out_features
    attn = 2 * L * c.n_head * c.head_dim * K
    return Work(weights + kv, weights, 2 * B * (macs + attn), 2 * B * attn, K)


WORK["llama"] = llama_work

MODELS = {
    "smollm2-fp32": lambda: model.load("smollm2", device="cpu", precision="fp32"),
    "smollm2-int8": lambda: model.load("smollm2", device="cpu", precision="int8"),
    "smollm2-int4": lambda: model.load("smollm2", device="cpu", precision="int4"),
}
TARGET = 6.0  # issue 42: 16 streams ÷ 1 stream, recur alone, at 512 tokens of history each


def section(r: dict) -> str:
    m = r["machine"]
    before = {(d["model"], d["batch"]): d for d in r.get("before", {}).get("decode", [])}
    lines = [
        SECTION,
        "",
        f"`python bench/llm.py`, 1 torch thread, {m['cores']} cores; the machine read {m['bandwidth_1t']} GB/s "
        f"and multiplied {m['gemm_1t']} GFLOP/s (fp32 GEMM) on one thread at best, {m['bandwidth_1t_lowest']} "
        f"GB/s at worst ({m['samples']} samples: a shared machine). The state is full ({r['span']}), except in the "
        f"rows after {r['history']} tokens of history (the smaller K).",
        "",
        "| weights | batch | K | MB a step | MFLOP a step | ms a step | tokens/s | bandwidth roofline | compute roofline | kernels | top ops |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in r["decode"]:
        lines.append(
            f"| {d['model'].removeprefix('smollm2-')} | {d['batch']} | {d['attention_length']} | {d['mb_per_step']} | "
            f"{d['mflop_per_step']} | {d['step_ms']} | {d['tokens_per_s']} | {d['bandwidth_roofline']:.1%} | "
            f"{d['compute_roofline']:.1%} | {d['kernel_share']:.0%} | {_ops(d)} |"
        )
    lines += ["", *_batching(r)]
    if before:
        lines += ["", *_before(r, before)]
    lines += ["", "Prefill of a 2,048-token prompt (chunks of `tgt_len`, best of 3):", ""]
    lines += ["| weights | tokens/s | compute roofline | kernels |", "|---|---|---|---|"]
    for p in r["prefill"]:
        lines.append(
            f"| {p['model'].removeprefix('smollm2-')} | {p['tokens_per_s']} | {p['compute_roofline']:.1%} | "
            f"{p['kernel_share']:.0%} |"
        )
    for s in r["skipped"]:
        lines.append(
            f"\nBatch {s['batch']} of {s['model']} was skipped: its states need {s['gib']} GiB at the peak."
        )
    again = f" --baseline {r['before']['commit']}" if before else ""
    lines += ["", *WHY, "", f"Reproduce: `python bench/llm.py{again}` (`--write` rewrites this section).", ""]
    return "\n".join(lines)


WHY = [
    "Where the time goes. A decode step reads every weight once: at batch 1 it is bound by memory "
    "bandwidth, and packed weights (int8 about a quarter of fp32's bytes, int4 a sixth) are the lever. At a "
    "few rows the packed layers run torch's weight-only kernels on bfloat16 activations "
    "(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`; model/int8.py, model/int4.py), and the int4 "
    "kernel works a row at a time: a 16-row step multiplies every weight 16 times, the later rows from cache, "
    "so the packed paths gain less from batching than fp32's GEMM, which reads its weights once for all the "
    "rows. As the batch grows the attention over the window (K keys and values a layer, for every stream) "
    "becomes most of the bytes a step moves: at batch 64 the step is attention-bound whatever the weights' "
    "format, and its attention kernel leads the profile.",
    "",
    "The attention reads each layer's keys and values where they lie in the state's arena. With one query per "
    "row and more than one row (a decode step of a batch) torch's fused CPU attention kernel "
    "(`_scaled_dot_product_flash_attention_for_cpu`) reads each once, the sinks joined by log-sum-exp "
    "(`_fused` in model/attention.py; 1.33-1.40x the two products over 30 layers at 16 rows, the whole "
    "16-row step 1.11-1.17x: section Attention over many rows); one row takes one product per key/value "
    "head, with the streams as its batch axis (`_in_place`). Before, "
    "`torch.matmul` folded streams and heads into one axis, which for a window inside an arena "
    "([B, L, capacity, kvh·hd]: one stream's rows of a layer are L·capacity rows from the next's) cannot be a "
    "view, so it copied every layer's window twice a step: the `copy_` at the top of the rows before, about "
    "half the step at batch 16 and more at 64. What still copies a window is the arena's growth: once every "
    "64 steps (model/state/arena.py, `ARENA_SLACK`) its spare rows run out and the window moves to a new arena, "
    "1/64 of a window a step on average, which the median step above leaves out.",
]


def _batching(r: dict) -> list[str]:
    """16 rows ÷ 1 row of each weight format, at the short history and at the full window,
    against issue 42's target (the short history's)."""
    rows = {(d["model"], d["history"], d["batch"]): d for d in r["decode"]}
    lines = [
        f"What batching buys (issue 42: 16 streams ÷ 1 stream, recur alone, >= {TARGET:.0f}x at "
        f"{r['history']} tokens of history each; at a full window, with the bytes a step reads; the rows after "
        f"{r['history']} tokens are in the table above beside the full window's):",
        "",
        "| weights | history, tokens | 1 row, tokens/s | 16 rows, tokens/s | 16 ÷ 1 | MB a 16-row step reads | of which keys and values | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for (name, history, B), d in rows.items():
        one = rows.get((name, history, 1))
        if B != 16 or one is None:
            continue
        ratio = d["tokens_per_s"] / one["tokens_per_s"]
        verdict = "(reported)"
        if history == r["history"]:
            verdict = "met" if ratio >= TARGET else f"**missed** by {TARGET / ratio:.1f}x"
        kv = d["mb_per_step"] - d["weight_mb"]
        lines.append(
            f"| {name.removeprefix('smollm2-')} | {history} | {one['tokens_per_s']} | {d['tokens_per_s']} | "
            f"{ratio:.2f}x | {d['mb_per_step']} | {kv:.1f} ({kv / d['mb_per_step']:.0%}) | {verdict} |"
        )
    return lines


def _ops(d: dict) -> str:
    return ", ".join(f"{o['op']} {o['share']:.0%}" for o in d["top_ops"][:3])


def _before(r: dict, before: dict[tuple[str, int], dict]) -> list[str]:
    """The decode rows next to the same rows of the baseline commit's model/, measured in
    this run just before (`--baseline`)."""
    lines = [
        f"The same decode steps on the code before (commit {r['before']['commit']}, its model/ with this "
        "bench/), measured in this run. At batch 1 the two run the same products (one stream's window folds "
        "into a batch axis without a copy), so what differs there is the shared machine's load between the two.",
        "",
        "| weights | batch | ms a step before | ms a step now | tokens/s before | tokens/s now | now ÷ before | top ops before |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in r["decode"]:
        b = before.get((d["model"], d["batch"]))
        if b is not None:
            lines.append(
                f"| {d['model'].removeprefix('smollm2-')} | {d['batch']} | {b['step_ms']} | {d['step_ms']} | "
                f"{b['tokens_per_s']} | {d['tokens_per_s']} | {d['tokens_per_s'] / b['tokens_per_s']:.2f}x | "
                f"{_ops(b)} |"
            )
    return lines


def baseline(commit: str, args: argparse.Namespace) -> dict | None:
    """This script's decode figures on `commit`'s model/ (no prefill: the change measured
    is the decode step's), or None where git cannot give that tree."""
    with model_at(commit) as tree:
        if tree is None:
            return None
        extra = ["--only", args.only] if args.only else []
        result = run(
            "llm.py", "--batches", args.batches, "--budget", str(args.budget), "--prefill-tokens", "0", *extra,
            env={"PYTHONPATH": str(tree)},
        )  # fmt: skip
    return {"commit": commit, "decode": result["decode"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64", help="batches at a full window")
    ap.add_argument("--history", type=int, default=512, help="tokens of history of the batching rows")
    ap.add_argument("--history-batches", default="1,16", help="batches after --history tokens (empty: none)")
    ap.add_argument("--budget", type=float, default=4.0, help="seconds of timed decode steps per figure")
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--only", help="comma list of: " + ", ".join(MODELS))
    ap.add_argument("--compiled", action="store_true", help="also compile and probe the engine's step (long)")
    ap.add_argument("--write", action="store_true", help="put the section into docs/BENCHMARKS.md")
    ap.add_argument("--baseline", help="a commit whose model/ to measure first, side by side (decode only)")
    args = ap.parse_args()
    before = baseline(args.baseline, args) if args.baseline else None
    batches = [int(b) for b in args.batches.split(",")]
    m = Machine()
    torch.set_num_threads(1)
    with profile():  # the profiler's first start is slow: keep it out of the figures
        torch.ones(8).sum()
    steps: list[dict] = []
    prefills: list[dict] = []
    skipped: list[dict] = []
    span = ""
    for i, name in enumerate(args.only.split(",") if args.only else MODELS):
        if i:
            m.sample()
        lm = MODELS[name]()
        span = f"sinks {lm.config.sinks} + window {lm.config.window}"
        served = served_step(lm)[0] if args.compiled else None
        steps += decode(name, lm, batches, args.budget, skipped, served)
        short = [int(b) for b in args.history_batches.split(",") if b]
        steps += decode(name, lm, short, args.budget, skipped, served, history=args.history)
        if args.prefill_tokens:
            prefills.append(prefill(name, lm, args.prefill_tokens, served))
        del lm
    m.sample()
    against(steps, prefills, m)
    result = {"machine": m.summary(), "span": span, "decode": steps, "prefill": prefills, "skipped": skipped}
    result["history"] = args.history
    result["threads"], result["cpus"] = 1, os.cpu_count()
    if before is not None:
        result["before"] = before
    print(section(result))
    if args.write:
        write_section(SECTION, section(result))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
