"""Many streams at the price of few (issue 30): every figure of its targets, in one run.

Model level (1 torch thread, eager steps, each batch's step timed in turn, several
rounds, the best round's median kept, so that a burst of load on the shared machine
moves every batch alike):
  1. tokens/s of a 16-row and a 64-row decode step ÷ a 1-row step, shipped `shakespeare`;
     16 ÷ 1 for shipped `shakespeare-rlt`;
  2. the batch-64 step of `shakespeare` as a fraction of the 1-thread GEMM rate measured
     here; batch-1 steps of Transformer-XL 6 × 512 (mem 512) and 6 × 256 at attention
     length 3,800 as a fraction of the 1-thread read bandwidth measured here (the bytes
     and FLOPs a step must move and do are bench/roofline.py's `work`);
  3. `shakespeare-rlt` prefill tokens/s at 8k ÷ at 2k (`lm.consume`, the lengths in turn,
     best of 3);
  and where the misses come from: the attention kernels side by side against a contiguous
  read of as many bytes (`attention_kernels`), the cost of each row a batch adds by kind of
  work (`per_row`), the step's linear layers at 1 and 16 rows by each of the torch wheel's
  matrix libraries (`small_gemms`), new cache buffers with huge pages and without
  (`relayouts`), and what a stream joining or leaving a batch costs (`restacks`).
Over HTTP (a `recur serve` process, Redis, 1 torch thread, compile off, default settings
otherwise):
  4. aggregate tokens/s of 16 streams ÷ 1 stream, with TTFT and ITL p50/p90/p99 at 1, 16
     and 64 streams (bench/serving.py's streams: 64 tokens each, temperature 0.8);
  5. p99 inter-token latency of 15 decoding streams while an 8,000-token prompt arrives
     (a `score`) ÷ their p99 without it (chunked prefill, `prefill_tokens_per_step`);
  6. a 5,000-token `score` on `shakespeare-rlt` over HTTP: tokens/s ÷ the model-level
     prefill tokens/s of the same prompt, and where the gap goes: in each round the score
     over HTTP (its wall time, and the CPU time the server process spent on it), then the
     same prompt through an in-process `Engine` (the scheduler and runner, no HTTP) and
     through `lm.consume`, each with its wall and CPU time (best of the rounds).
Against HF (`.venv-ref`, transformers 4.37.2, bench/hf_transfo_xl.py in a subprocess):
  7. the decode step of HF TransfoXL ÷ recur's on the same weights (6 × 512, mem 512),
     batch 1 and 16, 1 torch thread; recur's log-probs after the step are checked
     against HF's (the same model), HF timed before and after recur (best of both).

`--write` puts the section into docs/BENCHMARKS.md (harness.write_section).
Usage: python bench/streams.py [--write] [--only model,hf,http] [--render RESULT.json]

The measuring lives in a module per level: streams_model.py (the model level), streams_hf.py
(against HF) and streams_http.py (over HTTP). This file holds the targets, the page that
renders their figures into the section, and the entry point.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from harness import ROOT, emit, write_section
from streams_hf import hf_level
from streams_http import http_level
from streams_model import model_level

from model.state.arena import ARENA_SLACK

HEADING = "## 12. Many streams"
TARGETS = {
    "txl_16": 8.0,
    "txl_64": 16.0,
    "rlt_16": 6.0,
    "gemm_64": 0.5,
    "bw_6x512": 0.5,
    "bw_3800": 0.5,
    "http_16": 8.0,
    "rlt_8k_2k": 0.8,
    "rlt_http_score": 0.7,
    "stall_p99": 2.0,  # at most
    "hf_1": 10.0,
    "hf_16": 25.0,
}


ROWS = [  # key, figure, issue 30's "today"
    ("txl_16", "shipped `shakespeare`, tokens/s of a 16-row decode step ÷ a 1-row step", "3.3×"),
    ("txl_64", "shipped `shakespeare`, 64 rows ÷ 1 row", "4.7×"),
    ("rlt_16", "shipped `shakespeare-rlt`, 16 rows ÷ 1 row", "2.2×"),
    ("gemm_64", "batch-64 decode, shipped `shakespeare`, fraction of the measured GEMM rate", "25%"),
    ("bw_6x512", "batch-1 decode, Transformer-XL 6 × 512 mem 512, bandwidth roofline", "40%"),
    ("bw_3800", "batch-1 decode, attention length 3,800, bandwidth roofline", "37%"),
    ("http_16", "aggregate tokens/s over HTTP/SSE, 16 streams ÷ 1 stream", "2.2×"),
    ("rlt_8k_2k", "shipped `shakespeare-rlt`, prefill tokens/s at 8k ÷ at 2k (model level)", "not measured"),
    (
        "rlt_http_score",
        "shipped `shakespeare-rlt`, 5,000-token `score` over HTTP ÷ model-level prefill",
        "0.2–0.6",
    ),
    ("stall_p99", "p99 ITL of 15 streams while an 8,000-token prompt arrives ÷ without", "not measured"),
    ("hf_1", "decode step vs HF TransfoXL 4.37.2 on the same weights (6 × 512, mem 512), batch 1", "5–9×"),
    ("hf_16", "the same, batch 16", "17–25×"),
]
FRACTIONS = {"gemm_64", "bw_6x512", "bw_3800"}
PLAIN = {"rlt_8k_2k", "rlt_http_score"}  # ratios of rates, shown without ×


def shown(key: str, value: float) -> str:
    if key in FRACTIONS:
        return f"{value:.0%}"
    return f"{value:.2f}" if key in PLAIN else f"{value:.2f}×"


def verdict(key: str, value: float) -> tuple[str, str]:
    """(the figure as written, met / missed by how much)."""
    target = TARGETS[key]
    if key == "stall_p99":
        return shown(key, value), "met" if value <= target else f"**missed** ({value / target:.2f}× over)"
    return shown(key, value), "met" if value >= target else f"**missed** ({target / value:.2f}× short)"


def figures(result: dict) -> dict[str, float]:
    m, h = result.get("model", {}), result.get("http", {})
    out = {k: m[k] for k in ("txl_16", "txl_64", "rlt_16", "rlt_8k_2k") if k in m}
    out.update({k: m[k]["fraction"] for k in FRACTIONS if k in m})
    out.update({k: h[k] for k in ("http_16", "rlt_http_score", "stall_p99") if k in h})
    out.update({k: v for k, v in result.get("hf", {}).items() if k in TARGETS})
    return out


def gap_text(g: dict) -> str:
    """Where a 5,000-token RLT `score` over HTTP loses against the model level (`score_gap`)."""
    h, e, m = g["http"], g["engine"], g["model"]
    busy = h["cpu_s"] / h["wall_s"]
    return (
        f"**RLT's {g['tokens']:,}-token `score`, where the time goes** (the fastest of the rounds, each "
        f"taken three ways in turn): over HTTP {h['tokens_per_s']} tokens/s ({h['wall_s']} s; the server "
        f"process used {h['cpu_s']} s of CPU in it); through an `Engine` in the benchmark's process "
        f"(scheduler and runner; no HTTP, sessions or Redis) {e['tokens_per_s']} tokens/s ({e['wall_s']} s, "
        f"{e['cpu_s']} s of CPU); `lm.consume` {m['tokens_per_s']} tokens/s ({m['wall_s']} s, {m['cpu_s']} s "
        f"of CPU). The engine keeps {e['tokens_per_s'] / m['tokens_per_s']:.0%} of the model-level rate, and "
        f"the serving path around it (HTTP, the sessions service, Redis, a second process) "
        f"{h['tokens_per_s'] / e['tokens_per_s']:.0%} of the engine's. The server was on a core for "
        f"{busy:.0%} of the request's wall time"
        + (": the rest it waited for one (the machine's load), not work of its own." if busy < 0.9 else ".")
        + f" Its CPU time is {h['cpu_s'] / m['cpu_s']:.2f}× the model level's: "
        + ("the serving path adds little work; the gap is the machine's noise."
           if h["cpu_s"] / m["cpu_s"] < 1.15 else "the serving path adds work of its own.")
    )  # fmt: skip


def hf_text(r: dict) -> str:
    return (
        f"**Against HF TransfoXL 4.37.2** (`.venv-ref`, bench/hf_transfo_xl.py; the same random weights, "
        f"saved by HF and loaded by recur's model/hf.py; 6 × 512, mem 512, attention length 513; 1 torch "
        f"thread; HF timed before and after recur, the better kept): HF's decode step {r['hf_ms']} ms, "
        f"recur's {r['recur_ms']} ms by batch. recur's log-probs after the step differ from HF's by at most "
        f"{r['max_abs_logprob_diff']:.1e}."
    )


def section(result: dict) -> str:
    lines = [HEADING, "", "Written by `python bench/streams.py --write` (`make bench`); every figure from one run. "
             "Model level: 1 torch thread, eager steps, each batch's step timed in turn over several rounds "
             "(the best round's median). Over HTTP: `recur serve`, 1 torch thread, compile off. "
             f"The machine's load average (1 minute) was {result.get('load_before')} at the start and "
             f"{result.get('load_after')} at the end: on 2 cores, a load above 2 means other jobs took "
             "cores from these figures, and every figure here is then noise-bound.", ""]  # fmt: skip
    m = result.get("model", {})
    if m:
        lines += [f"Limits measured in this run (1 thread, the best of three samples: at the start, before the "
                  f"roofline steps and at the end; the lowest in brackets): read {m['read_gbs']} GB/s "
                  f"({m.get('read_gbs_lowest', '?')}), GEMM {m['gemm_gflops']} GFLOP/s ({m.get('gemm_gflops_lowest', '?')}). "
                  f"Every fraction of a limit below is of the best sample. Steps (ms): `shakespeare` {m['txl_ms']}, `shakespeare-rlt` {m['rlt_ms']}; "
                  f"`shakespeare-rlt` prefill tokens/s {m['rlt_prefill']}.", ""]  # fmt: skip
    lines += ["| figure | before (issue 30) | target | measured | |", "|---|---|---|---|---|"]
    got = figures(result)
    beyond = {k for k, f in floors(m).items() if f["floor_ms"] > f["need_ms"]} if m else set()
    if m and result.get("hf") and hf_batch1_share(m, result["hf"]) > 1:
        beyond.add("hf_1")
    for key, label, before in ROWS:
        t = TARGETS[key]
        target = ("≤ " if key == "stall_p99" else "≥ ") + (f"{t:.0%}" if key in FRACTIONS else f"{t:g}")
        target += "" if key in FRACTIONS | PLAIN else "×"
        measured, v = verdict(key, got[key]) if key in got else ("not measured", "")
        if key in beyond:
            v += "; beyond this machine in fp32 (see below)"
        lines.append(f"| {label} | {before} | {target} | {measured} | {v} |")
    h = result.get("http", {})
    if h:
        cols = [c for c in h["levels"][0] if c != "rounds"]
        rounds = h["levels"][0].get("rounds", 1)
        lines += ["", f"TTFT and ITL over HTTP/SSE (64 tokens per stream; each count measured in {rounds} "
                  "rounds, every count in turn within a round, and the round with the most tokens/s kept):", "",
                  "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]  # fmt: skip
        lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in h["levels"]]
        s = h["stall"]
        lines += ["", f"While an 8,000-token prompt arrives, the 15 streams' p99 ITL is {s['p99_during_ms']} ms "
                  f"against {s['p99_alone_ms']} ms without it (`prefill_tokens_per_step` 32: the prompt is "
                  "consumed 32 tokens per step while they decode).", "", gap_text(h["rlt_score"])]  # fmt: skip
    if "hf" in result:
        lines += ["", hf_text(result["hf"])]
    return "\n".join(lines) + "\n\n" + why(result) + "\n"


def ops(prof: dict) -> str:
    return ", ".join(f"{o['op']} {o['share']:.0%}" for o in prof["top_ops"][:5])


def whose_gap(step_ms: float, floor_ms: float) -> str:
    """What the step's distance from the floor of this run's limits says: within 1.25x of it
    the machine bounds the step, past that the code does."""
    if step_ms <= 1.25 * floor_ms:
        return "so the GEMM-rate fraction is bound by the machine's limits as measured here before any code."
    return (
        f"and the step takes {step_ms / floor_ms:.1f}× that: the gap is the code's (the ops below), "
        "not the machine's."
    )


def rlt_kernel_text(att: dict, rlt: dict) -> str:
    """Whether RLT would gain from the one-pass products, from this run's side-by-side figures
    and its 16-row step's profile (RLT keeps `sdpa`)."""
    gain = max(att[("shakespeare-rlt", B)]["speedup"] for B in (16, 64))
    if gain <= 1.05:
        return "The one-pass products do not beat `sdpa` at RLT's shapes, so RLT keeps it."
    share = sum(o["share"] for o in rlt["top_ops"] if "scaled_dot_product" in o["op"])
    return (
        f"At RLT's shapes the one-pass products beat `sdpa` in this run by up to {gain:.2f}×; "
        f"attention is {share:.0%} of RLT's 16-row step, so even this gain would take at most {share * (1 - 1 / gain):.0%} off it, and RLT "
        "keeps `sdpa`."
    )


def why(result: dict) -> str:
    """The misses explained from this run's own measurements: the profiles, the attention
    kernels side by side, the limits and the load."""
    m, hf = result.get("model"), result.get("hf")
    if not m:
        return ""
    p, g, att = m["profiles"], m["gemm_64"], {(r["model"], r["batch"]): r for r in m["attention"]}
    txl, rlt = p["shakespeare"], p["shakespeare-rlt"]
    floor_ms = sum(step_floor(txl["work"][64], m))
    sp = {k: f"{r['speedup']:.2f}×" for k, r in att.items()}
    share = sum(o["share"] for o in txl["top_ops"] if o["op"] in ("bmm", "baddbmm"))
    in_step = txl["kv_mb"] / (share * m["txl_ms"][64])  # MB / ms = GB/s
    text = [
        f"**Why the misses, and what would close them** (from this run; load average {result.get('load_before')} "
        f"to {result.get('load_after')} on 2 cores). A 64-row `shakespeare` step took {m['txl_ms'][64]} ms for "
        f"{g['mb']} MB and {g['mflop']} MFLOP: at the limits measured in this run ({m['read_gbs']} GB/s, "
        f"{m['gemm_gflops']} GFLOP/s; compare section 1's) those alone need {floor_ms:.1f} ms in turn (`step_floor`), "
        f"{whose_gap(m['txl_ms'][64], floor_ms)} Its profile: kernels "
        f"{txl['kernel_share']:.0%} of the step, {txl['ops_per_call']} ops per step; by self time {ops(txl)}. "
        f"The two attention products (`baddbmm`, `bmm`: {share:.0%} of the step) read {txl['kv_mb']} MB of "
        f"cached keys and values at {in_step:.1f} GB/s; `copy_` includes the arena's row writes, one element "
        "per cache line on a time-major cache.",
        "Side by side (`attention_kernels`: one layer's cache, small enough to stay in the last-level cache "
        "between calls), `attend_one` against the fused `sdpa` it replaced: "
        f"{sp[('shakespeare', 16)]} at 16 rows and {sp[('shakespeare', 64)]} at 64 at `shakespeare`'s shapes "
        f"(the faster reading its 64-row cache at {att[('shakespeare', 64)]['read_gbs']} GB/s); at "
        f"`shakespeare-rlt`'s (4 heads × 32, no position term) {sp[('shakespeare-rlt', 1)]}, "
        f"{sp[('shakespeare-rlt', 16)]} and {sp[('shakespeare-rlt', 64)]} at 1, 16 and 64 rows. "
        + rlt_kernel_text(att, rlt)
        + f" Its 16-row step's profile: kernels {rlt['kernel_share']:.0%}, {rlt['ops_per_call']} ops per step; "
        f"{ops(rlt)}." + plain_read_text(att),
    ]
    if "per_row" in m:
        text.append(per_row_text(m))
    if hf:
        text += hf_why(m, hf)
    text.append(floors_text(m))
    if "relayouts" in m:
        text.append(relayouts_text(m["relayouts"]))
    if "restacks" in m:
        text.append(restacks_text(m["restacks"]))
    text += http_why(m, result.get("http", {}))
    return "\n\n".join(text)


def plain_read_text(att: dict) -> str:
    """The attention kernels against a contiguous read of as many bytes (`kernel_pair`)."""
    if "of_plain_read" not in att[("shakespeare", 16)]:
        return ""
    r = [att[("shakespeare", B)]["of_plain_read"] for B in (16, 64)]
    return (
        " Against a contiguous read of as many bytes (a sum over a buffer the size of the cache, warm like "
        f"it), the faster kernel at `shakespeare`'s shapes runs at {r[0]:.0%} of that read's speed at 16 rows "
        f"and {r[1]:.0%} at 64."
    )


REMEDIES = {
    "linear layers": "a small-batch matrix product that overlaps its weight reads with its FMAs",
    "copies": "appends that write whole cache lines (a time-major cache writes one element per line; a "
    "(layer × head, row, time, d_head) layout would write d_head contiguous values)",
    "attention": "an attention nearer the read floor of its cache",
    "the rest": "fewer and cheaper elementwise ops per row",
}


def per_row_text(m: dict) -> str:
    """Where a batch's added rows go (`per_row`), against what the 16 ÷ 1 target allows and
    the floor each kind of work has per added row."""
    p = m["per_row"]
    one, many, n = p["ms"][1], p["ms"][p["rows"]], p["rows"]
    # µs per added row the target allows, from the unprofiled 1-row step (the profiler's cost
    # per op is in both profiled steps alike, so it cancels in `per`, not in a step's time)
    allowed = m["txl_ms"][1] * (n / TARGETS["txl_16"] - 1) / (n - 1) * 1e3
    per = {k: (many[k] - one[k]) / (n - 1) * 1e3 for k in one}
    cache_us = p["kv_mb_per_row"] / m["read_gbs"] * 1e3
    weights_ms = p["weights_mb"] / m["read_gbs"]
    flops_ms = n * one["linear layers"] * p["linear_gflops"][1] / m["gemm_gflops"]  # the 1-row FLOPs, n times
    floor = {"linear layers": (max(weights_ms, flops_ms) - weights_ms) / (n - 1) * 1e3, "attention": cache_us}
    excess = sorted(
        ((k, v - floor.get(k, 0.0)) for k, v in per.items() if k != "step"), key=lambda kv: -kv[1]
    )
    return (
        f"**Where the added rows go** (`per_row`: the 1-row and {n}-row `shakespeare` steps, each the mean of "
        f"{ARENA_SLACK} steps under the profiler, one re-layout among them): {one['step']} and {many['step']} ms, so each "
        f"added row costs {per['step']:.0f} µs, where {TARGETS['txl_16']:g}× allows {allowed:.0f} µs (from the "
        f"unprofiled 1-row step, {m['txl_ms'][1]} ms). By kind (µs "
        "per added row): " + ", ".join(f"{k} {v:.0f}" for k, v in per.items() if k != "step") + ". "
        f"A row's own cache is {p['kv_mb_per_row']} MB, {cache_us:.0f} µs at the read rate. The linear layers share "
        f"their {p['weights_mb']} MB of weights across the rows: reading them takes {weights_ms:.2f} ms and {n} rows' "
        f"FLOPs at the GEMM rate {flops_ms:.2f} ms, so a product that overlapped the two would add "
        f"{floor['linear layers']:.0f} µs per row; in the step MKL's {n}-row products take "
        f"{many['linear layers'] / one['linear layers']:.1f}× the 1-row ones, at {p['linear_gflops'][n]} GFLOP/s "
        f"({p['linear_gflops'][n] / m['gemm_gflops']:.0%} of this run's GEMM rate).{small_gemms_text(m)} Over those "
        "floors, each added row costs "
        + ", ".join(f"{k} {v:.0f} µs" for k, v in excess if v > 0)
        + "".join(f" ({k}: at or under its floor)" for k, v in excess if v <= 0)
        + f", and {n} ÷ 1 at {TARGETS['txl_16']:g}× needs {per['step'] - allowed:.0f} µs of it gone. What would "
        "close it (and HF at batch 16, the same step at 6 × 512), largest share first: "
        + "; ".join(REMEDIES[k] for k, v in excess if v > 0)
        + "."
    )


def small_gemms_text(m: dict) -> str:
    """The step's products at 1 and 16 rows, MKL as run and the wheel's packed paths (`small_gemms`)."""
    g = m.get("small_gemms")
    if not g:
        return ""
    parts = ", ".join(
        f"{way} {r['ms'][1]} → {r['ms'][16]} ms ({r['16_over_1']:.2f}×)" for way, r in g.items()
    )
    fastest = min(g, key=lambda way: g[way]["ms"][16])
    best1 = min(r["ms"][1] for r in g.values())
    return (
        f" Alone, with their weights hot (`small_gemms`, 1 → 16 rows): {parts}. The fastest at 16 rows "
        f"({fastest}) still takes {g[fastest]['ms'][16] / best1:.1f}× the fastest 1-row products: neither of "
        "the torch wheel's matrix libraries (MKL, oneDNN) serves 16 rows at the price of one."
    )


def hf_why(m: dict, hf: dict) -> list[str]:
    """Against HF: what each batch's target needs of recur's step, against the roofline and
    the floor of this run's limits."""
    out: list[str] = []
    r1, r16 = hf["recur_ms"][1], hf["recur_ms"][16]
    bw, goal, need = m["bw_6x512"], hf["hf_ms"][1] / TARGETS["hf_1"], hf_batch1_share(m, hf)
    out.append(
        f"Against HF: HF's batch-1 step is {hf['hf_ms'][1]} ms, so {TARGETS['hf_1']:g}× needs recur's in "
        f"{goal:.1f} ms; recur's (here {r1} ms) has the shape of the 6 × 512 row above (native weights), which took "
        f"{bw['step_ms']} ms at {bw['fraction']:.0%} of this run's read roofline: {goal:.1f} ms would be "
        f"{need:.0%} of it{', beyond the roofline at the read rate measured here' if need > 1 else ''}. At batch 16 recur's step grows {r16 / r1:.1f}× "
        f"over batch 1 and HF's {hf['hf_ms'][16] / hf['hf_ms'][1]:.1f}×."
    )
    if "work" in hf:
        w = hf["work"]
        goal16 = hf["hf_ms"][16] / TARGETS["hf_16"]
        kv_ms, lin_ms = step_floor(w, m)
        out.append(
            f"At batch 16, {TARGETS['hf_16']:g}× needs recur's step in {goal16:.1f} ms (here {r16} ms): its "
            f"{w['kv_mb']} MB of cached keys and values at the read rate take {kv_ms:.1f} ms and its linear "
            f"layers {lin_ms:.1f} ms, {kv_ms + lin_ms:.1f} ms in turn, so the target is "
            + ("beyond this machine in fp32." if kv_ms + lin_ms > goal16 else
               f"within this machine's limits, and the step is {r16 / (kv_ms + lin_ms):.1f}× that floor.")
        )  # fmt: skip
    return out


def http_why(m: dict, h: dict) -> list[str]:
    """Where the HTTP ratio goes: the server's cores and CPU per token at 1 and 16 streams."""
    if not h or "server_cores" not in h["levels"][0]:
        return []
    out: list[str] = []
    by = {r["streams"]: r for r in h["levels"]}
    per_token = m["txl_ms"][16] / 16
    out.append(
        f"Over HTTP the server process was on {by[1]['server_cores']} cores at 1 stream and "
        f"{by[16]['server_cores']} at 16, and spent {by[1]['server_cpu_ms_per_token']} and "
        f"{by[16]['server_cpu_ms_per_token']} ms of CPU per token, where the 16-row step alone costs "
        f"{per_token:.3f} ms per token. The engine thread and the event loop take turns on the GIL (each op "
        "of the eager step takes it between kernels), so the loop's per-token work (SSE framing, the "
        "middleware stack, the sessions service) adds to the step instead of running beside it on the "
        "second core. The HTTP ratio is bounded by the model-level ratio and by that per-token work: what "
        "would close it is a decode step that holds the GIL once (a compiled or C++ step) and fewer "
        "Python layers per SSE event."
    )
    return out


def step_floor(w: dict, m: dict) -> tuple[float, float]:
    """The floor this run's limits set for a decode step of work `w` (MB, MFLOP, and the MB of
    cached keys and values among them), as (cache ms, linear-layer ms). One thread runs the
    kernels in turn, so the two add: the attention products stream the cache at the read rate
    (next to no FLOPs), and the linear layers take the longer of reading their weights and
    doing their FLOPs at the GEMM rate."""
    cache_ms = w["kv_mb"] / m["read_gbs"]  # MB / (GB/s) = ms
    return cache_ms, max((w["mb"] - w["kv_mb"]) / m["read_gbs"], w["mflop"] / m["gemm_gflops"])


def hf_batch1_share(m: dict, hf: dict) -> float:
    """The fraction of this run's read roofline a batch-1 step would need to be HF's step ÷
    the hf_1 target (above 1: beyond the roofline), from the 6 × 512 row of the same shape."""
    bw = m["bw_6x512"]
    return bw["fraction"] * bw["step_ms"] * TARGETS["hf_1"] / hf["hf_ms"][1]


FLOOR_LABELS = {
    "txl_16": "16 rows ÷ 1 at 8×",
    "txl_64": "64 rows ÷ 1 at 16×",
    "gemm_64": "64 rows at 50% of GEMM",
}


def floors(m: dict) -> dict[str, dict]:
    """For each batched model-level target: the step it needs, and the floor this run's
    limits set for it (`step_floor`); also the figure a step at that floor would reach."""
    w, t1 = m["profiles"]["shakespeare"]["work"], m["txl_ms"][1]
    out = {}
    for key, B in (("txl_16", 16), ("txl_64", 64), ("gemm_64", 64)):
        mflop, kv = w[B]["mflop"], w[B]["kv_mb"]
        read_ms, gemm_ms = step_floor(w[B], m)
        floor = read_ms + gemm_ms
        if key == "gemm_64":
            need, best = mflop / (TARGETS[key] * m["gemm_gflops"]), mflop / m["gemm_gflops"] / floor
        else:
            need, best = B * t1 / TARGETS[key], B * t1 / floor
        out[key] = {"rows": B, "need_ms": need, "read_ms": read_ms, "gemm_ms": gemm_ms, "floor_ms": floor,
                    "at_floor": best, "step_ms": m["txl_ms"][B], "kv_mb": kv}  # fmt: skip
    return out


def floors_text(m: dict) -> str:
    """Which batched targets this machine allows at all (`floors`)."""
    w1 = m["profiles"]["shakespeare"]["work"][1]
    parts = []
    for key, f in floors(m).items():
        at = f"{f['at_floor']:.0%}" if key in FRACTIONS else f"{f['at_floor']:.1f}×"
        verdict = (
            "beyond this machine: no code reaches it in fp32 here"
            if f["floor_ms"] > f["need_ms"]
            else f"within this machine's limits; the step is {f['step_ms'] / f['floor_ms']:.1f}× the floor"
        )
        parts.append(
            f"{FLOOR_LABELS[key]}: "
            f"the target needs a {f['rows']}-row step of {f['need_ms']:.2f} ms; its {f['kv_mb']} MB of cached "
            f"keys and values at the read rate take {f['read_ms']:.2f} ms and its linear layers "
            f"{f['gemm_ms']:.2f} ms, {f['floor_ms']:.2f} ms in turn, where the figure would be {at}: {verdict}"
        )
    return (
        "**What this machine allows** (`floors`: each target's step against the floor this run's limits set "
        "for it; a one-thread step runs its kernels in turn, so the cache reads and the linear layers add): "
        + "; ".join(parts)
        + f". The 1-row step these ratios divide by is itself near its floor (its {w1['mb']} MB at the read rate "
        f"take {w1['mb'] / m['read_gbs']:.2f} ms of its {m['txl_ms'][1]} ms): a batch shares the weights, but "
        "each row brings its own cache, so the ratio of a large batch is bounded by how its cache grows."
    )


def relayouts_text(rows: list[dict]) -> str:
    """New cache buffers with huge pages and without, side by side (`relayouts`)."""
    parts = [
        f"{r['batch']} rows ({r['cache_mb']} MB of keys and values): stacking {r['stack']['plain']} → "
        f"{r['stack']['huge']} ms ({r['stack']['speedup']:.2f}×), the step that lays them out in new arenas "
        f"{r['relayout_step']['plain']} → {r['relayout_step']['huge']} ms ({r['relayout_step']['speedup']:.2f}×)"
        for r in rows
    ]
    return (
        "**New buffers on huge pages** (`relayouts`, plain → advised, side by side in this run): a batch's "
        "caches get new buffers when the batch is stacked (its membership changed) and every "
        "`ARENA_SLACK` (64) steps, when an arena's spare rows run out. Filling untouched memory faults "
        "its pages in one at a time; advised (`model.state.huge_pages`), 2 MiB at a time: "
        + "; ".join(parts)
        + ". The medians above leave the re-layout step out; a served batch pays it once per 64 steps. "
        "Below about 32 MB a buffer comes from memory glibc already holds, so there is nothing to gain."
    )


def restacks_text(rows: list[dict]) -> str:
    """A batch's membership change, stacked plainly and into arenas, side by side (`restacks`)."""
    parts = [f"{r['batch']} rows {r['plain']} → {r['arenas']} ms ({r['speedup']:.2f}×)" for r in rows]
    return (
        "**A stream joining or leaving** (`restacks`, side by side in this run): the runner re-stacks its "
        "batch whenever its membership changes, and that step costs the stack plus whatever the first "
        "decode step copies. Stacked plainly, the first step then copies every row again into arenas laid "
        "out for decoding; `lm.stack_states` stacks the rows straight into such arenas (`batch_layouts`), "
        "so the first step appends in place. The cost of a change, plain → into arenas: "
        + "; ".join(parts)
        + ". It still grows with the batch: every row is copied once per change."
    )


def int_keys(x):
    """JSON's string keys back to the batch sizes they were ("64" -> 64)."""
    if isinstance(x, dict):
        return {int(k) if k.isdigit() else k: int_keys(v) for k, v in x.items()}
    return [int_keys(v) for v in x] if isinstance(x, list) else x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="model,hf,http")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--write", action="store_true")
    ap.add_argument(
        "--render", type=Path, help="write the section from a saved run's RESULT JSON, measuring nothing"
    )
    ap.add_argument(
        "--root", type=Path, default=ROOT, help="the source tree the server runs (a before/after)"
    )
    args = ap.parse_args()
    if args.render:
        result = int_keys(json.loads(args.render.read_text().removeprefix("RESULT ")))
        write_section(HEADING, section(result))
        return
    which = set(args.only.split(","))
    result = {"load_before": round(os.getloadavg()[0], 1)}
    if "model" in which:
        result["model"] = model_level(args.rounds)
    if "hf" in which:
        result["hf"] = hf_level(args.rounds)
    if "http" in which:
        result["http"] = http_level(args.reps, args.root)
    result["load_after"] = round(os.getloadavg()[0], 1)
    for key, value in figures(result).items():
        print(f"{key}: {verdict(key, value)}", flush=True)
    if args.write:
        write_section(HEADING, section(result))
    emit(result)


if __name__ == "__main__":
    main()
