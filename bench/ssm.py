"""State-space models (Mamba, Mamba-2) against the machine's limits, measured in one run.

1. The machine's limits (`roofline.Machine`: read bandwidth and the fp32 GEMM rate, 1 thread,
   sampled before each model and at the end; every fraction is of the best sample).
2. Decode, 1 torch thread, batch 1, 16 and 64: a Mamba and a Mamba-2 the size of the shipped
   Transformer-XL (`shakespeare-mamba` where it is shipped, else random weights of its
   config), and a Mamba-130M-shaped Mamba (HF `state-spaces/mamba-130m-hf`'s config, random
   weights). A step is the server's: `next_logits`, pick, `lm(ids, state)`, timed as the server
   runs it (the engine's `DecodeStep`: compiled where its background probe adopted the
   compiled step; `--eager` skips the compile) and eager. Its bytes: every
   weight once, and the whole state read and written (an SSM rewrites all of it every
   token). Its FLOPs: 2 x every weight matrix's multiply-adds (the head's too) + the scan's,
   per row. Fractions of the bandwidth and GEMM rooflines, and the profile.
3. Prefill, 1 thread: tokens/s of `lm.consume` on a 2,048-token prompt (the chunked parallel
   scan, `segment_len` tokens a call) against a token-by-token loop (`lm(ids[:, t:t+1])`, the
   decode step's path, eager and as served; an SSM's step costs the same at every position,
   so the loop is timed on the prompt's first `--loop-tokens`). Target: >= 5x the eager loop.
4. Cost against history, the Transformer-XL-sized models: a 32-token request (the state
   read from its bytes, 32 greedy steps, the new state written to bytes) on a session
   holding 100k tokens of history / on one holding 1k. Target: <= 1.05 (the state does not grow).
5. Persistence: `bench/persistence.py`'s 64-token generate against a real Redis, at the
   server's defaults (delta writes + hot cache) and at its worst (full state, no cache), for
   the Transformer-XL-sized models, fp32 and bf16 state storage. Target: <= 5%.

Usage: python bench/ssm.py [--only NAME,...] [--write]   (--write: docs/BENCHMARKS.md's section)
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from harness import Redis, arguments, publish
from persistence import CONFIGS, run_config
from roofline import Machine, Work, batch_row, best_of, served_step, step_rooflines, weight_bytes

import model
from model import LanguageModel, State
from model.checkpoint import build

SECTION = "## 13. State-space models"
SHAKESPEARE_MAMBA = dict(n_layer=8, d_model=256, d_state=16, tgt_len=128)
SHAKESPEARE_MAMBA2 = dict(n_layer=8, d_model=256, d_state=32, head_dim=32, chunk_size=32, tgt_len=128)
MAMBA_130M = dict(vocab_size=50280, n_layer=24, d_model=768, d_state=16, tgt_len=256)


def _random(family: str, cfg: dict) -> LanguageModel:
    torch.manual_seed(0)
    return build(family, {"tie_weights": True, **cfg}).eval()


def shakespeare_mamba2() -> tuple[LanguageModel, str]:
    if "shakespeare-mamba" in model.shipped():
        return model.load("shakespeare-mamba", device="cpu"), "shipped `shakespeare-mamba`"
    return _random("mamba2", SHAKESPEARE_MAMBA2), "random weights"


MODELS = {
    "mamba-8x256": lambda: (_random("mamba", SHAKESPEARE_MAMBA), "random weights"),
    "mamba2-8x256": shakespeare_mamba2,
    "mamba-130m": lambda: (
        _random("mamba", MAMBA_130M),
        "random weights, state-spaces/mamba-130m-hf's shape",
    ),
}
SMALL = ("mamba-8x256", "mamba2-8x256")  # the Transformer-XL-sized ones


def ssm_work(lm: LanguageModel, state: State) -> Work:
    """Bytes and FLOPs one decode step must move and do (module docstring)."""
    macs = sum(m.weight.numel() for m in lm.modules() if isinstance(m, torch.nn.Linear | torch.nn.Conv1d))
    L, ssm = lm.config.n_layer, state["ssm"][0, 0].numel()  # one layer's state, per row
    scan = 2 * L * ssm  # h <- a h + (Delta x) B, then y = h C: two multiply-adds per state entry
    weights = weight_bytes(lm)
    state_bytes = sum(t.numel() * t.element_size() for k, t in state.tensors.items() if k != "n_tokens")
    return Work(
        weights + 2 * state_bytes,
        weights,
        2 * state.batch_size * (macs + scan),
        2 * state.batch_size * scan,
        0,
    )


@torch.no_grad()
def decode(
    name: str, lm: LanguageModel, batches: list[int], budget_s: float, served: Any | None
) -> list[dict]:
    """Each batch's decode step (roofline.batch_row)."""
    one = lm.consume(
        torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(0)), lm.new_state(1)
    )[1]
    own = {"state_kb_per_row": round(one.nbytes() / 1e3, 1)}
    return [batch_row(name, lm, one, B, budget_s, served, ssm_work, lambda _: own) for B in batches]


@torch.no_grad()
def prefill(name: str, lm: LanguageModel, tokens: int, loop_tokens: int, served: Any | None) -> dict:
    """The prompt through `lm.consume` (the parallel scan) against a token-by-token loop, the
    loop eager (the target's baseline, as eager as the prefill) and through the served step."""
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(1))
    lm.consume(ids[:, : lm.segment_len], lm.new_state(1))  # warm-up
    chunked = best_of(lambda: lm.consume(ids, lm.new_state(1)), 3)
    n = min(loop_tokens, tokens)

    def loop(step: Any) -> None:
        state = lm.new_state(1)
        for t in range(n):
            _, state = step(ids[:, t : t + 1], state)

    eager = n / best_of(lambda: loop(lm), 2)
    compiled = served is not None and served.serves_compiled(1)
    stepped = n / best_of(lambda: loop(served), 2) if compiled else eager
    row = {
        "model": name,
        "tokens": tokens,
        "chunked_tokens_per_s": round(tokens / chunked, 1),
        "loop_tokens": n,
        "loop_tokens_per_s": round(eager, 1),
        "speedup": round((tokens / chunked) / eager, 2),
        "served_loop_tokens_per_s": round(stepped, 1),
        "speedup_over_served_loop": round((tokens / chunked) / stepped, 2),
    }
    print(
        f"{name:13s} prefill {tokens}: {row['chunked_tokens_per_s']:8.0f} tok/s, token by token "
        f"{row['loop_tokens_per_s']:8.0f} eager ({row['speedup']:.1f}x), {stepped:8.0f} served "
        f"({row['speedup_over_served_loop']:.1f}x)",
        flush=True,
    )
    return row


@torch.no_grad()
def request_ms(lm: LanguageModel, blob: bytes, tokens: int = 32) -> float:
    """One request: the state from its bytes, `tokens` greedy steps, the new state's bytes."""
    t0 = time.perf_counter()
    state = lm.load_state(blob)
    ids = torch.zeros(1, 1, dtype=torch.long)
    for _ in range(tokens):
        ids[:, 0] = lm.next_logits(state).argmax(-1)
        _, state = lm(ids, state)
    state.to_bytes()
    return (time.perf_counter() - t0) * 1e3


@torch.no_grad()
def history(name: str, lm: LanguageModel, lengths: tuple[int, int] = (1_000, 100_000)) -> dict:
    g = torch.Generator().manual_seed(2)
    blobs = {
        n: lm.consume(torch.randint(0, 256, (n,), generator=g), lm.new_state(1))[1].to_bytes()
        for n in lengths
    }
    ms: dict[int, list[float]] = {n: [] for n in lengths}
    for _ in range(21):  # alternating, so machine noise falls on both alike
        for n in lengths:
            ms[n].append(request_ms(lm, blobs[n]))
    short, long = (min(ms[n]) for n in lengths)  # noise on a shared machine only adds time
    row = {
        "model": name,
        "short_history": lengths[0],
        "long_history": lengths[1],
        "state_bytes": {n: len(b) for n, b in blobs.items()},
        "short_ms": round(short, 2),
        "long_ms": round(long, 2),
        "ratio": round(long / short, 3),
    }
    print(
        f"{name:13s} 32-token request: {short:.1f} ms at {lengths[0]:,}, {long:.1f} ms at {lengths[1]:,}: {row['ratio']}"
    )
    return row


def persistence(name: str, lm: LanguageModel, redis: Redis) -> list[dict]:
    rows = []
    for dtype in ("float32", "bfloat16"):
        for cname, kw in (CONFIGS[3], CONFIGS[0]):  # the defaults, and the worst case
            r = asyncio.run(run_config(lm, redis.url, cname, {**kw, "state_dtype": dtype}, 2048, 8, 64))
            rows.append({"model": name, "state_dtype": dtype, **r})
            print(
                f"{name:13s} {dtype:8s} {cname:26s} persistence share {r['persistence_share']:.2%}",
                flush=True,
            )
    return rows


# -- the section of docs/BENCHMARKS.md -------------------------------------------------------
SHARES = {"bandwidth_roofline", "compute_roofline", "kernel_share", "persistence_share"}  # shown as %


def _table(rows: list[dict], cols: list[str]) -> list[str]:
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return out + ["| " + " | ".join(_cell(c, r[c]) for c in cols) + " |" for r in rows]


def _cell(col: str, v: object) -> str:
    return f"{v:.1%}" if col in SHARES and isinstance(v, float) else str(v)


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


DECODE_COLUMNS = [
    "model",
    "batch",
    "state_kb_per_row",
    "mb_per_step",
    "mflop_per_step",
    "step_ms",
    "eager_step_ms",
]
DECODE_COLUMNS += [
    "compiled",
    "tokens_per_s",
    "bandwidth_roofline",
    "compute_roofline",
    "kernel_share",
    "ops_per_call",
]
PREFILL_COLUMNS = ["model", "tokens", "chunked_tokens_per_s", "loop_tokens", "loop_tokens_per_s", "speedup"]
PREFILL_COLUMNS += ["served_loop_tokens_per_s", "speedup_over_served_loop"]
HISTORY_COLUMNS = ["model", "short_history", "short_ms", "long_history", "long_ms", "ratio"]
PERSIST_COLUMNS = ["model", "state_dtype", "config", "write_bytes", "read_ms", "write_ms", "request_ms"]
PERSIST_COLUMNS += ["persistence_share"]


def targets(r: dict) -> list[str]:
    """The target table: prefill, cost against history, persistence at the server's defaults."""
    lines = ["| target | measured | |", "|---|---|---|"]
    for p in r["prefill"]:
        lines.append(
            f"| prefill at {p['tokens']} tokens ÷ token by token (eager), `{p['model']}`: ≥ 5× "
            f"| {p['speedup']}× | {_verdict(p['speedup'] >= 5)} |"
        )
    for h in r["history"]:
        lines.append(
            f"| 32-token request at {h['long_history']:,} tokens of history ÷ at {h['short_history']:,}, "
            f"`{h['model']}`: ≤ 1.05 | {h['ratio']} | {_verdict(h['ratio'] <= 1.05)} |"
        )
    for p in r["persistence"]:
        if p["config"] == CONFIGS[3][0] and p["state_dtype"] == "float32":
            lines.append(
                f"| persistence share of a 64-token request (server defaults), `{p['model']}`: ≤ 5% | "
                f"{p['persistence_share']:.2%} | {_verdict(p['persistence_share'] <= 0.05)} |"
            )
    return lines


def section(r: dict) -> str:
    m = r["machine"]
    models = "; ".join(f"`{k}` ({v})" for k, v in r["models"].items())
    lines = [
        SECTION,
        "",
        f"Written by `bench/ssm.py` ({r['date']}, 1 torch thread). This run's 1-thread limits: "
        f"{m['bandwidth_1t']} GB/s read, {m['gemm_1t']} GFLOP/s fp32 GEMM (the best of {m['samples']} "
        f"samples; the lowest: {m['bandwidth_1t_lowest']} GB/s, {m['gemm_1t_lowest']} GFLOP/s). Models: {models}. "
        "The 8 × 256 ones are the shipped Transformer-XL's size; `mamba2-8x256` is `shakespeare-mamba`'s config.",
        "",
        *targets(r),
        "",
        "**Decode.** A step must read every weight once and read and write the whole state (an SSM "
        "rewrites all of it every token); its FLOPs are every weight matrix's and the scan's, per row. "
        "**step_ms** is the step the server runs: compiled where the engine's background probe adopted it "
        "(`app/engine/compiler.py`); the profile (kernel share, ops) is the eager step's.",
        "",
        *_table(r["decode"], DECODE_COLUMNS),
        "",
        "**Prefill.** `lm.consume` (the chunked parallel scan, eager) against a token-by-token loop, eager "
        "(the target's baseline) and through the step the server runs; an SSM's step costs the same at "
        "every position, so the loop is timed on the prompt's first tokens.",
        "",
        *_table(r["prefill"], PREFILL_COLUMNS),
        "",
        "**Cost against history.** A request: the state read from its bytes, 32 greedy steps, the state "
        "written to bytes; the fastest of 21, the two histories alternating.",
        "",
        *_table(r["history"], HISTORY_COLUMNS),
        "",
        "**Persistence.** `bench/persistence.py`'s 64-token generate on 2,048 tokens of history against a "
        "real Redis. The state is one size at any history and a delta would be all of it, so every commit "
        "writes it whole (a snapshot).",
        "",
        *_table(r["persistence"], PERSIST_COLUMNS),
        "",
        "Reproduce: `python bench/ssm.py` (add `--write` to rewrite this section); `make bench` runs it.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = arguments(__doc__)
    ap.add_argument("--only", help="comma list of models: " + ", ".join(MODELS))
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--budget", type=float, default=2.0, help="seconds of timed decode steps per figure")
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--loop-tokens", type=int, default=256, help="tokens the token-by-token loop is timed on")
    ap.add_argument(
        "--history", type=int, default=100_000, help="the long history of the cost-against-history figure"
    )
    ap.add_argument("--eager", action="store_true", help="time the eager step only (no background compile)")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(MODELS)
    m = Machine()
    torch.set_num_threads(1)
    r: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "models": {},
        "compiled_step": {},
        "decode": [],
        "prefill": [],
        "history": [],
        "persistence": [],
    }
    redis = Redis(Path(tempfile.mkdtemp(prefix="recur-bench-")) / "redis")
    try:
        for i, name in enumerate(names):
            if i:
                m.sample()
            lm, r["models"][name] = MODELS[name]()
            served, r["compiled_step"][name] = (None, {}) if args.eager else served_step(lm)
            r["decode"] += decode(name, lm, [int(b) for b in args.batches.split(",")], args.budget, served)
            r["prefill"].append(prefill(name, lm, args.prefill_tokens, args.loop_tokens, served))
            if name in SMALL:
                r["history"].append(history(name, lm, (1_000, args.history)))
                r["persistence"] += persistence(name, lm, redis)
    finally:
        redis.stop()
    m.sample()
    r["machine"] = m.summary()
    step_rooflines(r["decode"], m, 13)
    publish(SECTION, section(r), r, args.write)


if __name__ == "__main__":
    main()
