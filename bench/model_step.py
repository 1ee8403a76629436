"""Model-level step costs, each reported as a ratio measured side by side in one run.

1. Per-token decode time with 1,000 vs 100,000 tokens of history (should be ~1: the
   state is bounded, so a decode step costs the same however long the stream).
2. Speedup of stateful decoding over recomputing an attention window from scratch for
   every token (the paper's vanilla-Transformer evaluation), at attention lengths 800,
   1,800, 2,800 and 3,800 (Dai et al. report 363x, 773x, 1,409x and 1,874x, on GPU).
   Context only, not a target: bench/roofline.py holds a step against the machine's limits.
3. A decode step that grows the state in place (the default) against one that builds it
   functionally (`model.FUNCTIONAL`: `torch.cat` the new row, slice the window),
   at 1 and 16 streams and two attention lengths. Results are the same (bit for bit
   here; tests/model/test_state.py checks them to 1e-5); only the copies differ.

4. The library's default, as docs/USING.md writes a decode (`lm(tok, st)`: no `how`, no
   `torch.no_grad`) on a model as `model.load` returns it (issue 42), against what that
   line ran before (functional, with the parameters tracking gradients), at Transformer-XL
   6 x 512, mem 512, 16 streams: `--library` runs this one alone.

`--profile 16` instead prints where a 16-stream decode step spends its time.

Usage: python bench/model_step.py [--d-model 256 --n-layer 4 ...] [--device cpu]
Random weights are fine: timing does not depend on what the weights are.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from model import FUNCTIONAL, IN_PLACE, Execution, LanguageModel
from model.checkpoint import build, resolve_device

PAPER = {800: 363, 1800: 773, 2800: 1409, 3800: 1874}  # Dai et al. 2019, Table 9


def make(args: argparse.Namespace, mem_len: int):
    torch.manual_seed(0)
    cfg = dict(
        n_layer=args.n_layer,
        d_model=args.d_model,
        n_head=args.n_head,
        d_head=args.d_model // args.n_head,
        d_inner=4 * args.d_model,
        mem_len=mem_len,
        tgt_len=args.chunk,
        dropout=0.0,
    )
    return build("transformer-xl", cfg).to(resolve_device(args.device)).eval(), cfg


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def decode_ms(lm, state, steps: int, how: Execution = IN_PLACE) -> float:
    """Median wall time of one decode step (next-token logits + consuming one token), grown
    as the engine's eager step grows it (in place), unless `how` says otherwise."""
    tok = torch.zeros(state.batch_size, 1, dtype=torch.long, device=lm.device)
    times = []
    for _ in range(steps):
        sync(lm.device)
        t0 = time.perf_counter()
        logits = lm.next_logits(state)
        tok[:, 0] = logits.argmax(-1)
        _, state = lm(tok, state, how)
        sync(lm.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@torch.no_grad()
def history_state(lm, n: int):
    ids = torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n))
    return lm.consume(ids, lm.new_state(1))[1]


@torch.no_grad()
def recompute_ms(lm, window: int, reps: int) -> float:
    """Vanilla evaluation: each new token re-runs the whole window from an empty state."""
    ids = torch.randint(0, 256, (1, window), device=lm.device)
    times = []
    for _ in range(reps):
        sync(lm.device)
        t0 = time.perf_counter()
        lm(ids, lm.new_state(1))
        sync(lm.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


@torch.no_grad()
def profile_step(lm, streams: int, steps: int = 50) -> None:
    """Where a batched decode step spends its time: the torch profiler's top operators."""
    from torch.profiler import profile

    state = lm.stack_states([history_state(lm, 300 + i) for i in range(streams)])
    decode_ms(lm, state, 10)  # warm-up
    with profile() as prof:
        decode_ms(lm, state, steps)
    print(f"profile of {steps} decode steps, {streams} streams:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def history_cost(lm: LanguageModel, steps: int) -> tuple[float, float]:
    """Per-token decode time (ms) with 1k and with 100k tokens of history."""
    short, long_ = history_state(lm, 1_000), history_state(lm, 100_000)
    decode_ms(lm, short, 20)  # warm-up
    # interleave the two measurements so machine noise hits both alike
    a, b = [], []
    for _ in range(5):
        a.append(decode_ms(lm, short, steps // 5))
        b.append(decode_ms(lm, long_, steps // 5))
    t1k, t100k = statistics.median(a), statistics.median(b)
    print(
        f"decode per token, history 1k: {t1k:.3f} ms   100k: {t100k:.3f} ms   ratio 100k/1k = {t100k / t1k:.3f}"
    )
    return t1k, t100k


def speedups(args: argparse.Namespace) -> list[dict]:
    """The stateful decode step against recomputing the whole window, per attention length."""
    out = []
    for window in (int(w) for w in args.windows.split(",")):
        lm2, _ = make(args, window)
        st = history_state(lm2, window)
        decode_ms(lm2, st, 5)
        t_dec = decode_ms(lm2, st, 50)
        t_full = recompute_ms(lm2, window, 3)
        out.append(
            {
                "attention_length": window,
                "stateful_decode_ms": round(t_dec, 3),
                "recompute_window_ms": round(t_full, 1),
                "speedup": round(t_full / t_dec, 1),
                "paper": PAPER.get(window),
            }
        )
        print(
            f"attention length {window}: stateful decode {t_dec:.3f} ms vs recompute {t_full:.1f} ms"
            f"   speedup = {t_full / t_dec:.0f}x   (paper: {PAPER.get(window, '-')}x)",
            flush=True,
        )
    return out


def growth(args: argparse.Namespace) -> list[dict]:
    """The decode step with the state grown in place against building it functionally."""
    out = []
    for window in (int(w) for w in args.growth_windows.split(",")):
        lm3, _ = make(args, window)
        for batch in (1, 16):
            st = lm3.stack_states([history_state(lm3, window)] * batch)
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(3):  # interleaved, so machine noise hits both alike
                for in_place in (True, False):
                    how = IN_PLACE if in_place else FUNCTIONAL
                    times[in_place].append(decode_ms(lm3, st, args.steps // 10, how))
            t_in, t_fn = min(times[True]), min(times[False])
            out.append(
                {
                    "attention_length": window,
                    "streams": batch,
                    "in_place_ms": round(t_in, 3),
                    "functional_ms": round(t_fn, 3),
                    "speedup": round(t_fn / t_in, 2),
                }
            )
            print(
                f"attention length {window}, {batch} streams: in place {t_in:.3f} ms vs functional "
                f"{t_fn:.3f} ms   = {t_fn / t_in:.2f}x",
                flush=True,
            )
    return out


def library_default(args: argparse.Namespace) -> dict:
    """A user's decode step through the library, as it runs now and as it ran before."""
    lm, _ = make(argparse.Namespace(**{**vars(args), "n_layer": 6, "d_model": 512, "n_head": 8}), 512)
    st = lm.stack_states([history_state(lm, 512)] * 16)
    tok = torch.zeros(16, 1, dtype=torch.long)

    def step_ms(before: bool) -> float:
        lm.requires_grad_(before)  # model.load's model tracks no gradient; before, it did
        times, state = [], st
        for _ in range(max(3, args.steps // 20)):  # a decode: each step extends the last
            t0 = time.perf_counter()
            _, state = lm(tok, state, FUNCTIONAL) if before else lm(tok, state)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    now, before = min(step_ms(False) for _ in range(2)), min(step_ms(True) for _ in range(2))
    print(
        f"the library's default decode step (Transformer-XL 6 x 512, mem 512, 16 streams, "
        f"{torch.get_num_threads()} threads): now {now:.1f} ms, before {before:.1f} ms = {before / now:.1f}x"
    )
    return {"now_ms": round(now, 2), "before_ms": round(before, 2), "speedup": round(before / now, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--mem-len", type=int, default=128, help="memory for benchmark 1")
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--windows", default="800,1800,2800,3800", help="attention lengths for benchmark 2")
    ap.add_argument("--growth-windows", default="128,3800", help="attention lengths for benchmark 3")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument(
        "--profile", type=int, metavar="STREAMS", help="only profile a decode step of this many streams"
    )
    ap.add_argument("--library", action="store_true", help="only measure the library's default (4)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.profile:
        profile_step(make(args, args.mem_len)[0], args.profile)
        return
    if args.library:
        print("RESULT " + json.dumps({"library_default": library_default(args)}))
        return
    lm, cfg = make(args, args.mem_len)
    t1k, t100k = history_cost(lm, args.steps)
    result = {
        "model": cfg,
        "device": str(lm.device),
        "threads": torch.get_num_threads(),
        "decode_ms_history_1k": round(t1k, 3),
        "decode_ms_history_100k": round(t100k, 3),
        "ratio_100k_over_1k": round(t100k / t1k, 3),
        "speedups": speedups(args),
        "growth": growth(args),
        "library_default": library_default(args),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
