"""Section 12's model level (bench/streams.py): eager decode steps of the shipped models timed at
1, 16 and 64 rows, their fractions of the limits sampled in the same run, RLT's prefill rate by
prompt length, and where the misses come from: the attention kernels side by side against a
contiguous read (`attention_kernels`), the cost of each row a batch adds by kind of work
(`per_row`), the step's linear layers by each of the torch wheel's matrix libraries
(`small_gemms`), new cache buffers with huge pages and without (`relayouts`), and a stream
joining or leaving a batch (`restacks`).

Measures only, in this process on 1 torch thread: it starts no server and writes no page
(bench/streams.py renders what `model_level` returns).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from roofline import MODELS, Machine, best_of, fill_length, profile_step, step, work
from serving import corpus_text
from torch.profiler import profile

import model
from model.state.arena import ARENA_SLACK
from model.transformer_xl import attend_one


@torch.no_grad()
def step_times(name: str, batches: list[int], rounds: int, steps: int) -> tuple[dict[int, float], dict]:
    """Seconds per eager decode step at each batch: per round, `steps` steps of each batch
    in turn; the best round's median. Then the largest batch's step profiled
    (roofline.profile_step: kernels' share, top ops by self time, ops per step)."""
    lm = MODELS[name]()
    one = filled(lm)
    states = {B: lm.stack_states([one] * B) for B in batches}
    best = {B: float("inf") for B in batches}
    for _ in range(rounds):
        for B in batches:
            ids = torch.zeros(B, 1, dtype=torch.long)
            s = step(lm, states[B], ids)
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                s = step(lm, s, ids)
                times.append(time.perf_counter() - t0)
            states[B] = s
            best[B] = min(best[B], statistics.median(times))
    print(f"{name}: " + ", ".join(f"{B} rows {t * 1e3:.3f} ms" for B, t in best.items()), flush=True)
    state = states[batches[-1]]
    prof = profile_step(lm, state, best[batches[-1]])[0]
    print(f"{name} {batches[-1]} rows: {prof}", flush=True)
    works = {B: work(lm, s) for B, s in states.items()}
    need = {B: {"mb": round(w.bytes / 1e6, 2), "mflop": round(w.flops / 1e6, 1), "kv_mb": cache_mb(states[B])}
            for B, w in works.items()}  # fmt: skip
    return best, {"batch": batches[-1], "kv_mb": cache_mb(state), "work": need, **prof}


def cache_mb(state) -> float:
    """MB of cached keys and values a decode step's attention reads (Transformer-XL's
    "k" and "v"; 0 for a family without them)."""
    names = [n for n in ("k", "v") if n in state.tensors]
    return round(sum(state[n].numel() * state[n].element_size() for n in names) / 1e6, 2)


def filled(lm) -> model.State:
    """One stream's state with every time axis full (`fill_length` random tokens, seed 0)."""
    ids = torch.randint(0, 256, (fill_length(lm),), generator=torch.Generator().manual_seed(0))
    return lm.consume(ids, lm.new_state(1))[1]


# a decode step's kernels by what they do, for `per_row`
OP_CLASSES = {
    "linear layers": ("aten::addmm", "aten::mm"),
    "attention": (
        "aten::bmm",
        "aten::baddbmm",
        "aten::_softmax",
        "aten::masked_fill_",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
    ),
    "copies": ("aten::copy_",),  # the cache appends among them
}


@torch.no_grad()
def per_row(name: str, rows: int, rounds: int) -> dict:
    """Where a batch's extra rows go: the 1-row and the `rows`-row step of `name` (filled
    states, eager) in turn over several rounds, each profiled over ARENA_SLACK steps (the
    mean: one re-layout of the arenas among them, as a served batch pays it); the best
    round kept. The kernels' self times by `OP_CLASSES`; "the rest" (Python, dispatch,
    every other op, and the profiler's own cost per op, the same at both sizes: it cancels
    in the cost per added row) is the profiled step less them. Also the bytes of cache each
    row adds and the linear layers' GFLOP/s. A ratio `rows` ÷ 1 of R needs each added row
    to cost at most (rows / R - 1) / (rows - 1) of the 1-row step."""
    lm = MODELS[name]()
    one = filled(lm)
    states = {B: lm.stack_states([one] * B) for B in (1, rows)}
    best: dict[int, dict] = {}
    for _ in range(rounds):
        for B in states:
            ids = torch.zeros(B, 1, dtype=torch.long)
            with profile(with_flops=True) as prof:
                t0 = time.perf_counter()
                for _ in range(ARENA_SLACK):
                    states[B] = step(lm, states[B], ids)
                wall = (time.perf_counter() - t0) / ARENA_SLACK
            if B not in best or wall < best[B]["step"]:
                best[B] = {"step": wall, **op_classes(prof, ARENA_SLACK, wall)}
    flops = {B: b.pop("linear_flops") for B, b in best.items()}
    return {"model": name, "rows": rows, "kv_mb_per_row": cache_mb(states[1]),
            "weights_mb": round(work(lm, states[1]).bytes / 1e6 - cache_mb(states[1]), 2),
            "ms": {B: {k: round(v * 1e3, 3) for k, v in b.items()} for B, b in best.items()},
            "linear_gflops": {B: round(flops[B] / best[B]["linear layers"] / 1e9, 1) for B in best}}  # fmt: skip


@torch.no_grad()
def small_gemms(rounds: int) -> dict:
    """The linear layers of a `shakespeare` decode step (every nn.Linear a step runs, in
    order, weights as loaded) at 1 and 16 rows, three ways in turn: `F.linear` (MKL, as the
    step runs them), and with the weights packed ahead for the batch size by MKL and by
    oneDNN (the torch wheel's own packed paths, where it has them). Seconds per step's worth
    of products, the best of the rounds; a 16-row step's ÷ a 1-row step's, per way."""
    lm = MODELS["shakespeare"]()
    layers = [
        (m.weight, m.bias)
        for n, m in lm.named_modules()
        if isinstance(m, torch.nn.Linear) and "r_net" not in n
    ]
    out: dict[str, dict] = {}
    for B in (1, 16):
        for way, fn in gemm_ways(layers, B).items():
            out.setdefault(way, {})[B] = best_of(fn, rounds * 10)
    rows = {way: {"ms": {B: round(t * 1e3, 3) for B, t in ts.items()}, "16_over_1": round(ts[16] / ts[1], 2)}
            for way, ts in out.items()}  # fmt: skip
    print(f"small GEMMs: {rows}", flush=True)
    return rows


def gemm_ways(layers: list, B: int) -> dict:
    """`small_gemms`' ways of running `layers` (weight, bias) on B rows."""
    xs = [torch.randn(B, w.shape[1]) for w, _ in layers]
    ways: dict[str, Callable[[], list]] = {
        "mkl": lambda: [F.linear(x, w, b) for x, (w, b) in zip(xs, layers, strict=True)]
    }
    try:
        mk = [torch.ops.mkl._mkl_reorder_linear_weight(w, B) for w, _ in layers]
        dn = [torch.ops.mkldnn._reorder_linear_weight(w, B) for w, _ in layers]
    except (AttributeError, RuntimeError):  # a torch build without them
        return ways
    ways["mkl_packed"] = lambda: [
        torch.ops.mkl._mkl_linear(x, p, w, b, B) for x, p, (w, b) in zip(xs, mk, layers, strict=True)
    ]
    ways["onednn_packed"] = lambda: [
        torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], "")
        for x, p, (_, b) in zip(xs, dn, layers, strict=True)
    ]
    return ways


def op_classes(prof, steps: int, wall: float) -> dict[str, float]:
    """Seconds per step of the kernels by `OP_CLASSES`, "the rest" of `wall` (a step's
    seconds), and the linear layers' FLOPs per step."""
    out = dict.fromkeys(OP_CLASSES, 0.0)
    flops = 0.0
    for e in prof.key_averages():
        cls = next((c for c, names in OP_CLASSES.items() if e.key in names), None)
        if cls is not None:
            out[cls] += e.self_cpu_time_total / 1e6 / steps
            flops += e.flops / steps if cls == "linear layers" else 0.0
    out["the rest"] = max(0.0, wall - sum(out.values()))
    return {**out, "linear_flops": flops}


@torch.no_grad()
def attention_kernels(rounds: int) -> list[dict]:
    """One query per (row, head) over a decode step's cache, side by side: the fused `sdpa`
    on row-major cache views (the position term as a float mask, where there is one) and
    `attend_one`'s two batched products on a time-major cache, at `shakespeare`'s shapes
    (4 heads × 64, 129 keys, a position term) and `shakespeare-rlt`'s (4 × 32, 128 keys)."""
    out = []
    for name, H, dh, K, pos in (("shakespeare", 4, 64, 129, True), ("shakespeare-rlt", 4, 32, 128, False)):
        for B in (1, 16, 64):
            row = {"model": name, "batch": B, **kernel_pair(B, H, dh, K, pos, rounds * 25)}
            print(row, flush=True)
            out.append(row)
    return out


def kernel_pair(B: int, H: int, dh: int, K: int, pos: bool, reps: int) -> dict:
    g = torch.Generator().manual_seed(B)
    q, kv = torch.randn(B, H, dh, generator=g), torch.randn(2, B, H * dh, K + 64, generator=g)
    k_tm, v_tm = kv[0, ..., :K].transpose(1, 2), kv[1, ..., :K].transpose(1, 2)  # (B, K, D), time-major
    k_rm, v_rm = k_tm.contiguous(), v_tm.contiguous()  # (B, K, D), row-major
    bias = torch.randn(B, H, K, generator=g) if pos else torch.zeros(B, H, K)
    mask = (bias * dh**-0.5)[:, :, None] if pos else None

    def fused() -> torch.Tensor:
        kh, vh = k_rm.view(B, K, H, dh).transpose(1, 2), v_rm.view(B, K, H, dh).transpose(1, 2)
        return F.scaled_dot_product_attention(q[:, :, None], kh, vh, attn_mask=mask)[:, :, 0]

    def one_pass() -> torch.Tensor:
        return attend_one(q, k_tm, v_tm, bias, None, dh**-0.5)

    flat = torch.randn(2 * B * H * dh * K, generator=g)  # as many bytes as the cache, contiguous

    def read() -> torch.Tensor:  # the floor: that many bytes streamed once, next to no arithmetic
        return flat.sum()

    diff = float((fused() - one_pass()).abs().max())
    sdpa, one, floor = best_of(fused, reps), best_of(one_pass, reps), best_of(read, reps)
    cache = 2 * B * K * H * dh * 4  # bytes of keys and values each must read
    return {"sdpa_us": round(sdpa * 1e6, 1), "one_pass_us": round(one * 1e6, 1), "speedup": round(sdpa / one, 2),
            "read_gbs": round(cache / min(sdpa, one) / 1e9, 2), "max_abs_diff": diff,
            "plain_read_us": round(floor * 1e6, 1), "of_plain_read": round(floor / min(sdpa, one), 2)}  # fmt: skip


@torch.no_grad()
def relayouts(rounds: int) -> list[dict]:
    """New buffers for a batch's caches, with huge pages (`model.state.huge_pages`) and
    without, in turn: stacking B filled `shakespeare` states into a batch, and the first
    in-place step on it, which lays the caches out in new arenas (as every ARENA_SLACK-th
    step re-lays them out)."""
    from model.state import arena

    lm = MODELS["shakespeare"]()
    one = filled(lm)
    advise, out = arena._MADVISE, []
    for B in (16, 64):
        ids = torch.zeros(B, 1, dtype=torch.long)
        best = {}
        for _ in range(rounds * 2):
            for way, fn in (("plain", None), ("huge", advise)):
                arena._MADVISE = fn
                try:
                    t0 = time.perf_counter()
                    batch = model.State.stack([one] * B)  # plain: its first step re-lays it out
                    t1 = time.perf_counter()
                    step(lm, batch, ids)
                    t2 = time.perf_counter()
                finally:
                    arena._MADVISE = advise
                del batch
                prev = best.get(way, (float("inf"), float("inf")))
                best[way] = (min(prev[0], t1 - t0), min(prev[1], t2 - t1))
        row = {"batch": B, "cache_mb": round(B * cache_mb(one), 2)}
        for i, what in enumerate(("stack", "relayout_step")):
            row[what] = {w: round(t[i] * 1e3, 2) for w, t in best.items()}
            row[what]["speedup"] = round(best["plain"][i] / best["huge"][i], 2)
        print(row, flush=True)
        out.append(row)
    return out


@torch.no_grad()
def restacks(rounds: int) -> list[dict]:
    """What a stream joining or leaving a served batch costs (the runner re-stacks the
    batch): B rows as a split batch leaves them (views of its arenas) stacked again, then
    two decode steps; the stack plus the first step, less the second. Two ways in turn:
    stacked plainly (the first step then copies every row into new arenas) and as
    `lm.stack_states` stacks them, straight into arenas of the decode step's layout
    (`batch_layouts`)."""
    lm = MODELS["shakespeare"]()
    one = filled(lm)
    out = []
    for B in (16, 64):
        ids = torch.zeros(B, 1, dtype=torch.long)
        rows = lm.split_state(step(lm, step(lm, lm.stack_states([one] * B), ids), ids))
        best: dict[str, float] = {}
        for _ in range(rounds * 2):
            for way, layouts in (("plain", None), ("arenas", lm.batch_layouts())):
                t0 = time.perf_counter()
                batch = step(lm, model.State.stack(rows, layouts), ids)
                t1 = time.perf_counter()
                step(lm, batch, ids)
                cost = 2 * t1 - t0 - time.perf_counter()  # stack + first step - second step
                best[way] = min(best.get(way, float("inf")), cost)
                del batch
        row = {"batch": B, **{w: round(t * 1e3, 2) for w, t in best.items()}, "speedup": round(best["plain"] / best["arenas"], 2)}  # fmt: skip
        print(row, flush=True)
        out.append(row)
    return out


@torch.no_grad()
def roofline_step(name: str, B: int, rounds: int) -> dict:
    """A step's time, bytes and FLOPs; `model_level` adds its fraction of the limit."""
    lm = MODELS[name]()
    one = filled(lm)
    state = lm.stack_states([one] * B)
    w = work(lm, state)
    t = step_times_on(lm, state, rounds)
    print(
        f"{name} batch {B}: {t * 1e3:.3f} ms for {w.bytes / 1e6:.1f} MB, {w.flops / 1e6:.1f} MFLOP",
        flush=True,
    )
    return {"model": name, "batch": B, "step_ms": round(t * 1e3, 3), "mb": round(w.bytes / 1e6, 2),
            "mflop": round(w.flops / 1e6, 1)}  # fmt: skip


def with_fraction(row: dict, limit: float, kind: str) -> dict:
    """The step's bytes/time ÷ the read bandwidth (kind "bandwidth") or FLOPs/time ÷ the GEMM
    rate ("gemm")."""
    amount = row["mb"] * 1e6 if kind == "bandwidth" else row["mflop"] * 1e6
    return {**row, "fraction": round(amount / (row["step_ms"] / 1e3) / limit, 3)}


def step_times_on(lm, state, rounds: int, steps: int = 10) -> float:
    ids = torch.zeros(state.batch_size, 1, dtype=torch.long)
    state = step(lm, state, ids)
    best = float("inf")
    for _ in range(rounds):
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            state = step(lm, state, ids)
            times.append(time.perf_counter() - t0)
        best = min(best, statistics.median(times))
    return best


@torch.no_grad()
def prefill_rate(name: str, lengths: list[int], rounds: int = 3) -> dict[int, float]:
    """Tokens/s of `lm.consume` from an empty state per prompt length: every length in turn,
    `rounds` times (so that a burst of load moves every length alike), the best of each."""
    lm = MODELS[name]()
    text = corpus_text(max(lengths))
    ids = torch.tensor(lm.tokenizer.encode(text)[: max(lengths)])
    lm.consume(ids[: lm.segment_len], lm.new_state(1))  # warm-up
    best = dict.fromkeys(lengths, float("inf"))
    for _ in range(rounds):
        for n in lengths:
            t0 = time.perf_counter()
            lm.consume(ids[:n], lm.new_state(1))
            best[n] = min(best[n], time.perf_counter() - t0)
    out = {n: n / t for n, t in best.items()}
    print(f"{name} prefill: " + ", ".join(f"{n} tokens {r:.0f} tok/s" for n, r in out.items()), flush=True)
    return out


def model_level(rounds: int) -> dict:
    """Every model-level figure. The limits are sampled at the start, before the roofline steps
    and at the end, and every fraction is of the best sample: a sample taken while another job
    ran reads low, and must not flatter a figure (the lowest shows how much the machine moved)."""
    machine = Machine()  # samples the limits (and sets 1 thread)
    txl, txl_prof = step_times("shakespeare", [1, 16, 64], rounds, 10)
    rlt, rlt_prof = step_times("shakespeare-rlt", [1, 16], rounds, 10)
    rlt_prefill = prefill_rate("shakespeare-rlt", [2048, 8192])
    machine.sample()
    steps = {"gemm_64": roofline_step("shakespeare", 64, rounds),
             "bw_6x512": roofline_step("txl-6x512-mem512", 1, rounds),
             "bw_3800": roofline_step("txl-6x256-len3800", 1, rounds)}  # fmt: skip
    out = {
        "profiles": {"shakespeare": txl_prof, "shakespeare-rlt": rlt_prof},
        "attention": attention_kernels(rounds),
        "per_row": per_row("shakespeare", 16, rounds),
        "small_gemms": small_gemms(rounds),
        "relayouts": relayouts(rounds),
        "restacks": restacks(rounds),
    }
    machine.sample()
    bw, gemm, seen = machine.best("bandwidth_1t"), machine.best("gemm_1t"), machine.summary()
    return out | {
        "read_gbs": round(bw / 1e9, 2),
        "gemm_gflops": round(gemm / 1e9, 2),
        "read_gbs_lowest": seen["bandwidth_1t_lowest"],
        "gemm_gflops_lowest": seen["gemm_1t_lowest"],
        "txl_ms": {B: round(t * 1e3, 3) for B, t in txl.items()},
        "rlt_ms": {B: round(t * 1e3, 3) for B, t in rlt.items()},
        "txl_16": round(16 * txl[1] / txl[16], 2),
        "txl_64": round(64 * txl[1] / txl[64], 2),
        "rlt_16": round(16 * rlt[1] / rlt[16], 2),
        "gemm_64": with_fraction(steps["gemm_64"], gemm, "gemm"),
        "bw_6x512": with_fraction(steps["bw_6x512"], bw, "bandwidth"),
        "bw_3800": with_fraction(steps["bw_3800"], bw, "bandwidth"),
        "rlt_prefill": {n: round(r, 1) for n, r in rlt_prefill.items()},
        "rlt_8k_2k": round(rlt_prefill[8192] / rlt_prefill[2048], 3),
    }
