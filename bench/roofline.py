"""Decode and prefill against the machine's limits, measured in the same run.

A stateful decode step must read every weight and the key/value state it attends over
once, so its floor is bytes ÷ memory bandwidth; a batched step must also do its matrix
multiplies, so its other floor is FLOPs ÷ the GEMM rate. This script measures both limits
on this machine, then puts every decode step next to them (gpt-fast's "bandwidth
achieved"), and says where a step's time goes.

1. The machine: read bandwidth (summing a 1 GiB fp32 tensor, best of 5) and the GEMM rate
   (a 2,048² fp32 matmul, best of 5), on 1 thread and on every core; and the rate at which
   a batch-1 linear layer (`F.linear`, 1 thread) reads a 256 MiB weight, the ceiling of an
   eager step's matrix-vector products. The 1-thread limits are sampled again before each
   model and at the end; every fraction is of the best sample (`Machine`).
2. Decode, 1 torch thread: both shipped models, a Transformer-XL 6 × 512 (mem 512) and a
   6 × 256 at attention length 3,800 (random weights), each at batch 1, 16 and 64 with
   the state filled to the attention length. A step is what the server's runner does:
   `lm.next_logits(state)`, pick a token, `lm(ids[:, None], state)`. Per step: the bytes
   it must move, the FLOPs it must do, the median time, the fraction of the bandwidth
   roofline (bytes/time ÷ 1-thread bandwidth) and of the compute roofline (FLOPs/time ÷
   1-thread GEMM rate), and a torch.profiler breakdown (`profile_step`).
3. Prefill, 1 torch thread: tokens/s of `lm.consume` on a 2,048-token prompt, both
   shipped models (best of 3).

The bytes a step must move (reads; the one row per layer a step writes is left out):
  Transformer-XL  weights (every parameter once, less r_net) + per layer the cached keys
                  and values over the attention length K = M + 1, 2·B·L·K·H·dh, + what
                  the position scores need, shared by the batch: W_{k,R} R over K
                  distances as a table per layer, L·K·H·dh, or r_net's weights and one
                  sinusoid table, L·H·dh·d + d·K, whichever is less; × 4 bytes (fp32)
  RLT             weights (every parameter once) + encoder keys/values 2·B·L_E·K_e·d +
                  per decoder layer its memory group's keys/values in reach 2·B·L_D·K_m·d +
                  the window caches 2·B·L_D·K_w·d (K = the rows cached + the new one);
                  × 4 bytes
The FLOPs it must do: 2 × (the matmuls' multiply-adds): B × (every weight matrix once,
the head once) + attention, B × L × K × H·dh × 3 for Transformer-XL (content scores,
position scores, weighted values), B × 2·d × K per attention for RLT.

`--only shakespeare-rlt` (a name or a comma list) measures just those models; with
PYTHONPATH pointing at an older checkout's tree it measures that code (how RLT_BASELINE
was recorded). Random weights are fine for timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import profile

import model
from model import LanguageModel, State
from model.checkpoint import build

# shipped `shakespeare-rlt` before issue 14's work, the targets' baseline (3x these):
# commit ad05664's model/, measured with this script on 2026-11-30 on the 2-core AMD EPYC
# dev machine, 1 torch thread, the best of ten runs of
#   git archive ad05664 model | tar -x -C /tmp/base
#   PYTHONPATH=/tmp/base python bench/roofline.py --only shakespeare-rlt
# The machine was shared (load 1 to 6): across the runs decode read 147-512 tokens/s and
# prefill 311-1025, so the best is the fairest baseline (noise only adds time). `make
# bench` also re-measures that tree side by side in its own run (bench/report.py).
RLT_BASELINE = {"commit": "ad05664", "decode_tokens_per_s": 512.0, "prefill_tokens_per_s": 1025.0}
# how an eager decode step grows its state: in place. The baseline's model/ (which this script
# also measures, above) predates `model.Execution` and grew in place by default.
IN_PLACE = getattr(model, "IN_PLACE", None)

GIB = 1 << 30
# the profiler names of the compute kernels: matmuls and fused attention; everything else
# (small elementwise ops, norms, copies, indexing, views) and the time outside any op
# (Python, dispatch) is per-op overhead
KERNELS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::addmv",
    "aten::mv",
    "aten::dot",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
    "mkldnn::_linear_pointwise",
    "aten::_int_mm",
    "aten::_weight_int8pack_mm",  # the packed weights' kernels (model/int8.py, model/int4.py)
    "aten::_weight_int4pack_mm_for_cpu",
}


# -- the machine ---------------------------------------------------------------------------
def timings(fn, reps: int) -> list[float]:
    """The seconds of each of `reps` calls of `fn`."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def best_of(fn, reps: int) -> float:
    """The fastest of `reps` timed calls (noise on a shared machine only ever adds time)."""
    return min(timings(fn, reps))


def read_bandwidth(threads: int, size: int = GIB) -> float:
    """Bytes/s of a streaming read far beyond the caches: summing a 1 GiB fp32 tensor."""
    torch.set_num_threads(threads)
    x = torch.ones(size // 4)
    x.sum()  # first touch
    return size / best_of(lambda: x.sum(), 5)


def gemm_rate(threads: int, n: int = 2048) -> float:
    """FLOP/s of a square fp32 matmul (2·n³ FLOPs)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    return 2 * n**3 / best_of(lambda: a @ b, 5)


def gemv_bandwidth(rows: int = 16384, cols: int = 4096) -> float:
    """Bytes/s of the weight read by a batch-1 linear layer (`F.linear`, 1 thread, a 256 MiB
    weight): what an eager decode step's matrix-vector products can reach."""
    torch.set_num_threads(1)
    w, x = torch.randn(rows, cols), torch.randn(1, cols)
    F.linear(x, w)
    return w.numel() * w.element_size() / best_of(lambda: F.linear(x, w), 5)


def limits_1t() -> dict[str, float]:
    """The 1-thread limits every figure is held against."""
    return {"bandwidth_1t": read_bandwidth(1), "gemv_1t": gemv_bandwidth(), "gemm_1t": gemm_rate(1)}


class Machine:
    """The machine's limits, sampled at the start, before every model and at the end: on a
    shared machine a sample taken while another job runs reads low, so each figure is held
    against the best sample (a fraction can only read low, never flatter), and the spread
    of the samples shows how noisy the run was."""

    def __init__(self) -> None:
        self.cores = os.cpu_count() or 1
        self.all_cores = {"bandwidth_all": read_bandwidth(self.cores), "gemm_all": gemm_rate(self.cores)}
        self.samples: list[dict[str, float]] = []
        self.sample()

    def sample(self) -> None:
        s = limits_1t()
        self.samples.append(s)
        torch.set_num_threads(1)
        print(
            f"machine, 1 thread: read bandwidth {s['bandwidth_1t'] / 1e9:.1f} GB/s, batch-1 linear reads "
            f"its weight at {s['gemv_1t'] / 1e9:.1f} GB/s, fp32 GEMM {s['gemm_1t'] / 1e9:.1f} GFLOP/s",
            flush=True,
        )

    def best(self, key: str) -> float:
        return max(s[key] for s in self.samples)

    def summary(self) -> dict:
        out: dict = {"cores": self.cores, "samples": len(self.samples)}
        for key in self.samples[0]:
            out[key] = round(self.best(key) / 1e9, 2)
            out[key + "_lowest"] = round(min(s[key] for s in self.samples) / 1e9, 2)
        out.update({k: round(v / 1e9, 2) for k, v in self.all_cores.items()})
        return out


# -- what a step must do -------------------------------------------------------------------
@dataclass
class Work:
    bytes: int  # weights + state read
    weights: int  # of which weights
    flops: int
    attention_flops: int  # of which attention's (the rest: the weight matrices')
    attention_length: int


def weight_bytes(lm: LanguageModel, skip: str | None = None) -> int:
    """Every parameter once (tied ones once), less those whose name contains `skip`."""
    seen: dict[int, int] = {}
    for name, p in lm.named_parameters():
        if skip is None or skip not in name:
            seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())


def txl_work(lm: LanguageModel, state: State) -> Work:
    c = lm.config
    B, L, M, d = state["mem"].shape
    hd = c.n_head * c.d_head
    K = M + 1  # the cached rows and the new one
    size = state["mem"].element_size()
    kv = 2 * B * L * K * hd * size
    # the position scores need W_{k,R} R over the K distances, per layer: read as a projected
    # table (L·K·hd), or as r_net's weights (L·hd·d) and one sinusoid table R (d·K); the lesser
    positions = min(L * K * hd, L * hd * d + d * K) * size
    macs = L * (d * 3 * hd + hd * d + 2 * d * c.d_inner) + d * c.vocab_size
    attn = L * K * hd * 3
    weights = weight_bytes(lm, skip="r_net")
    return Work(weights + kv + positions, weights, 2 * B * (macs + attn), 2 * B * attn, K)


def rlt_work(lm: LanguageModel, state: State) -> Work:
    c = lm.config
    d, B = c.d_model, state.batch_size
    size = state["enc_k"].element_size()
    K_e = state["enc_k"].shape[2] + 1
    K_m = min(state["mem_k"].shape[2] + 1, c.max_context)
    K_w = state["swa_k"].shape[2] + 1
    reads = 2 * B * d * (c.n_encoder_layers * K_e + c.n_decoder_layers * (K_m + K_w)) * size
    macs = (
        c.n_encoder_layers * (4 * d * d + 2 * d * c.d_ff)  # q, k, v, out; FFN
        + 2 * c.memory_groups * d * d  # memory keys and values
        + (3 * d * d if c.feedback else 0)  # the merge's gate and W_s
        + c.n_decoder_layers * (6 * d * d + 2 * d * c.d_ff)  # self q, k, v, out; cross q, out; FFN
        + d * c.vocab_size
    )
    attn = 2 * d * (c.n_encoder_layers * K_e + c.n_decoder_layers * (K_m + K_w))
    weights = weight_bytes(lm)
    return Work(weights + reads, weights, 2 * B * (macs + attn), 2 * B * attn, K_e)


# family -> what its decode step must do (bench/llm.py adds the LLM family's)
WORK: dict[str, Callable[[LanguageModel, State], Work]] = {"transformer-xl": txl_work, "rlt": rlt_work}


def work(lm: LanguageModel, state: State) -> Work:
    return WORK[lm.family](lm, state)


# -- timing and profiling ------------------------------------------------------------------
Forward = Callable[[torch.Tensor, State], tuple[torch.Tensor, State]]


def eager(lm: LanguageModel, ids: torch.Tensor, state: State) -> tuple[torch.Tensor, State]:
    return lm(ids, state) if IN_PLACE is None else lm(ids, state, IN_PLACE)


def step(lm: LanguageModel, state: State, ids: torch.Tensor, forward: Forward | None = None) -> State:
    """One decode step, as `app/engine/runner.py` runs it (greedy picking in place of
    sampling); `forward` is the one-token forward the engine runs (`DecodeStep`), eager by
    default."""
    ids[:, 0] = lm.next_logits(state).argmax(-1)
    return (forward(ids, state) if forward is not None else eager(lm, ids, state))[1]


def time_steps(
    lm: LanguageModel, state: State, budget_s: float, forward: Forward | None = None
) -> tuple[float, State]:
    """Median seconds per decode step over about `budget_s` seconds (10 to 200 steps)."""
    ids = torch.zeros(state.batch_size, 1, dtype=torch.long)
    t0 = time.perf_counter()
    for _ in range(3):  # warm-up: the first step makes the arena the state then grows in
        state = step(lm, state, ids, forward)
    est = (time.perf_counter() - t0) / 3
    times = []
    for _ in range(max(10, min(200, int(budget_s / est)))):
        t0 = time.perf_counter()
        state = step(lm, state, ids, forward)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), state


def served_step(lm: LanguageModel) -> tuple[Any, dict]:
    """The decode step the server would run for this model on this machine: the engine's
    own `DecodeStep`, its background compile and probe run to the end here (it picks the
    compiled step per batch class where that was faster, `app/engine/compiler.py`; imported
    here, not at the top: the baseline run measures an older model/ today's app/ cannot import)."""
    from app.engine.compiler import DecodeStep

    served = DecodeStep(lm, compile=True)
    served.start()
    assert served._thread is not None
    served._thread.join()
    st = served.status
    verdicts = {
        str(v.rows): {
            "eager_ms": round(v.eager_ms, 3),
            "compiled_ms": round(v.compiled_ms, 3),
            "max_diff": v.max_diff,
            "adopted": v.adopted,
        }
        for v in st.verdicts.values()
    }
    summary = {"state": st.state, "seconds": round(st.seconds, 1), "error": st.error, "verdicts": verdicts}
    print(
        f"compiled step: {st.state} in {st.seconds:.0f} s; "
        + ", ".join(
            f"{k} row(s): eager {v['eager_ms']} ms, compiled {v['compiled_ms']} ms -> "
            + ("compiled" if v["adopted"] else "eager")
            for k, v in verdicts.items()
        ),
        flush=True,
    )
    return served, summary


def breakdown(prof, calls: int, wall_s: float) -> dict:
    """Where `calls` calls that took `wall_s` under the profiler spent it: the kernels'
    share (matmuls, attention), the top ops by self time, and ops per call. The profiler
    adds a little to every op, so for many small ops the overhead share reads a bit high."""
    totals: dict[str, float] = {}
    for e in prof.key_averages():
        totals[e.key] = totals.get(e.key, 0.0) + e.self_cpu_time_total / 1e6
    kernel = sum(v for k, v in totals.items() if k in KERNELS)
    ops = sum(1 for e in prof.events() if e.cpu_parent is None) / calls
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:6]
    share = min(1.0, kernel / wall_s)
    return {
        "kernel_share": round(share, 3),
        "overhead_share": round(1 - share, 3),
        "ops_per_call": round(ops) if ops >= 10 else round(ops, 1),
        "top_ops": [{"op": k.removeprefix("aten::"), "share": round(v / wall_s, 3)} for k, v in top],
    }


def profile_step(lm: LanguageModel, state: State, per_step_s: float) -> tuple[dict, State]:
    ids = torch.zeros(state.batch_size, 1, dtype=torch.long)
    steps = max(10, min(50, int(0.5 / per_step_s)))
    with profile() as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            state = step(lm, state, ids)
        wall = time.perf_counter() - t0
    return breakdown(prof, steps, wall), state


def batch_row(
    name: str,
    lm: LanguageModel,
    one: State,
    B: int,
    budget_s: float,
    served: Any | None,
    work_of: Callable[[LanguageModel, State], Work],
    columns: Callable[[Work], dict],
) -> dict:
    """A row of a decode table, printed as it comes: the step of a batch of `B` copies of the
    state `one`, what it must move (`work_of`; `columns`: the family's own figures of it),
    timed as the server runs it (`served`: compiled where its probe adopted the compiled
    step, else eager) and eager, with the eager step's profile (a compiled step's generated
    kernels hide where its time goes)."""
    state = lm.stack_states([one] * B)
    w = work_of(lm, state)
    eager, state = time_steps(lm, state, budget_s)
    prof, state = profile_step(lm, state, eager)
    compiled = served is not None and served.serves_compiled(B)
    t = eager
    if compiled:  # the server runs the compiled step for this batch: time that one too
        t, state = time_steps(lm, lm.stack_states([one] * B), budget_s, served)
    del state
    own = columns(w)
    print(
        f"{name:18s} batch {B:3d}  {w.bytes / 1e6:8.2f} MB  {w.flops / 1e6:8.1f} MFLOP  {t * 1e3:8.3f} ms "
        f"({'compiled' if compiled else 'eager'}; eager {eager * 1e3:.3f})  {B / t:8.0f} tok/s  "
        f"{where_time_goes(prof, 'ops')}  ({', '.join(f'{k} {v}' for k, v in own.items())})",
        flush=True,
    )
    return {
        "model": name,
        "batch": B,
        **own,
        "mb_per_step": round(w.bytes / 1e6, 2),
        "mflop_per_step": round(w.flops / 1e6, 1),
        "step_ms": round(t * 1e3, 3),
        "eager_step_ms": round(eager * 1e3, 3),
        "compiled": compiled,
        "tokens_per_s": round(B / t, 1),
        **prof,
    }


def where_time_goes(prof: dict, ops: str) -> str:
    """A profile (breakdown) for a progress line: the kernels' share, the ops per call (in
    `ops`), the top four ops by self time."""
    top = ", ".join(f"{o['op']} {o['share']:.0%}" for o in prof["top_ops"][:4])
    return f"kernels {prof['kernel_share']:5.1%}  {prof['ops_per_call']} {ops}  top: {top}"


# -- the models ----------------------------------------------------------------------------
def txl(n_layer: int, d_model: int, mem_len: int) -> LanguageModel:
    torch.manual_seed(0)
    cfg = dict(
        n_layer=n_layer,
        d_model=d_model,
        n_head=d_model // 64,
        d_head=64,
        d_inner=4 * d_model,
        mem_len=mem_len,
        tgt_len=128,
        dropout=0.0,
    )
    return build("transformer-xl", cfg).eval()


MODELS = {
    "shakespeare": lambda: model.load("shakespeare", device="cpu"),
    "shakespeare-rlt": lambda: model.load("shakespeare-rlt", device="cpu"),
    "txl-6x512-mem512": lambda: txl(6, 512, 512),
    "txl-6x256-len3800": lambda: txl(6, 256, 3800),
}


def fill_length(lm: LanguageModel) -> int:
    """Tokens that fill every time axis of the state to its bound."""
    return max(axis.bound for axis in lm.time_axes().values()) + 1


def available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return 1 << 62


def _columns(w: Work) -> dict:
    return {
        "attention_length": w.attention_length,
        "weight_mb": round(w.weights / 1e6, 2),
        "attention_mflop": round(w.attention_flops / 1e6, 1),
    }


@torch.no_grad()
def decode(
    name: str,
    lm: LanguageModel,
    batches: list[int],
    budget_s: float,
    skipped: list[dict],
    served: Any | None,
    history: int | None = None,
) -> list[dict]:
    """Each batch's decode step against the limits (batch_row), every row's state after
    `history` tokens (default: every time axis filled to its bound)."""
    n = history or fill_length(lm)
    one = lm.consume(
        torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(0)), lm.new_state(1)
    )[1]
    rows = []
    for B in batches:
        # the stacked batch, then the arena its first step copies it into (one window more)
        need = int(2.2 * one.nbytes() * B)
        if need > available_bytes() // 2:
            print(f"{name} batch {B}: skipped, its state needs {need / GIB:.1f} GiB at its peak", flush=True)
            skipped.append({"model": name, "batch": B, "gib": round(need / GIB, 1)})
            continue
        rows.append({**batch_row(name, lm, one, B, budget_s, served, work, _columns), "history": n})
    return rows


@torch.no_grad()
def prefill(name: str, lm: LanguageModel, tokens: int, served: Any | None) -> dict:
    """A prompt's prefill, as the server runs it (`served.prefill`: the model's compiled
    parts where the engine's probe adopted them) and eager; the profile is the eager one's."""
    ids = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(1))
    lm.consume(ids[: lm.segment_len], lm.new_state(1))  # warm-up
    eager = best_of(lambda: lm.consume(ids, lm.new_state(1)), 3)
    compiled = served is not None and bool(served._parts)
    t = eager
    if compiled:

        def run() -> None:
            served.prefill(lambda how: lm.consume(ids, lm.new_state(1), how))

        run()  # warm-up
        t = best_of(run, 3)
    # the profile: the first few chunks (the profiler's bookkeeping of every op of a long
    # prompt would take longer than the prompt)
    part = min(tokens, 4 * lm.segment_len)
    with profile() as prof:
        t0 = time.perf_counter()
        lm.consume(ids[:part], lm.new_state(1))
        wall = time.perf_counter() - t0
    prof_row = breakdown(prof, part, wall)
    full = lm.consume(ids[: fill_length(lm)], lm.new_state(1))[1]
    flops = work(lm, full).flops * tokens  # ≈: the first tokens of a prompt attend over less
    print(
        f"{name:18s} prefill {tokens} tokens: {t:.3f} s  {tokens / t:8.0f} tok/s "
        f"({'compiled parts' if compiled else 'eager'}; eager {tokens / eager:.0f} tok/s)  "
        f"{where_time_goes(prof_row, 'ops/token')}",
        flush=True,
    )
    return {
        "model": name,
        "tokens": tokens,
        "seconds": round(t, 3),
        "tokens_per_s": round(tokens / t, 1),
        "eager_tokens_per_s": round(tokens / eager, 1),
        "compiled": compiled,
        "mflop": round(flops / 1e6, 1),
        **prof_row,
    }


def step_rooflines(rows: list[dict], m: Machine, width: int) -> None:
    """Add each decode step's fractions of the rooflines: of the best samples of the limits
    (`m`), taken once every model has run (a sample taken while another job ran cannot
    flatter a figure); `width`: of the model's name in the progress lines."""
    bw, gemm = m.best("bandwidth_1t"), m.best("gemm_1t")
    for r in rows:
        t = r["step_ms"] / 1e3
        r["bandwidth_roofline"] = round(r["mb_per_step"] * 1e6 / t / bw, 3)
        r["compute_roofline"] = round(r["mflop_per_step"] * 1e6 / t / gemm, 3)
        print(
            f"{r['model']:{width}s} batch {r['batch']:3d}  bandwidth roofline {r['bandwidth_roofline']:6.1%}  "
            f"compute roofline {r['compute_roofline']:6.1%}"
        )


def against(rows: list[dict], prefills: list[dict], m: Machine) -> None:
    """Add each figure's fractions of the rooflines (the best samples of the limits)."""
    bw, gemm = m.best("bandwidth_1t"), m.best("gemm_1t")
    print(f"against the best samples: {bw / 1e9:.1f} GB/s read, {gemm / 1e9:.1f} GFLOP/s GEMM (1 thread)")
    step_rooflines(rows, m, 18)
    for r in prefills:
        r["compute_roofline"] = round(r["mflop"] * 1e6 / r["seconds"] / gemm, 3)
        print(f"{r['model']:18s} prefill  compute roofline {r['compute_roofline']:6.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma list of models: " + ", ".join(MODELS))
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--budget", type=float, default=2.0, help="seconds of timed decode steps per figure")
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument(
        "--eager",
        action="store_true",
        help="time the eager step only (no compiled step; an older tree's baseline)",
    )
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(MODELS)
    batches = [int(b) for b in args.batches.split(",")]

    m = Machine()
    torch.set_num_threads(1)  # every figure below: 1 torch thread
    with profile():  # the profiler's first start is slow: keep it out of the figures
        torch.ones(8).sum()
    steps: list[dict] = []
    prefills: list[dict] = []
    skipped: list[dict] = []
    compiles: dict[str, dict] = {}
    for i, name in enumerate(names):
        if i:
            m.sample()
        lm = MODELS[name]()
        served, compiles[name] = (None, {}) if args.eager else served_step(lm)
        steps += decode(name, lm, batches, args.budget, skipped, served)
        if name.startswith("shakespeare"):
            prefills.append(prefill(name, lm, args.prefill_tokens, served))
        del lm
    m.sample()
    against(steps, prefills, m)
    result = {
        "threads": torch.get_num_threads(),
        "machine": m.summary(),
        "decode": steps,
        "prefill": prefills,
        "skipped": skipped,
        "compiled_step": compiles,
        "rlt_baseline": RLT_BASELINE,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
