"""The hybrids (Gated DeltaNet or Mamba-2 with attention) beside the LLaMA window and Mamba-2:
what a session's state weighs against its history, and prefill and decode speed, measured
side by side in one run.

1. State bytes at 1k, 8k and 32k tokens of history: the bytes recur's state format writes
   for one stream (`State.to_bytes`, fp32, header included), from each model's state layout
   with its time axes as long as that history leaves them (no forward needed: the layout
   alone fixes the size). Shapes: the shipped hybrid's (`shakespeare-hybrid`, 6 × 160) and a
   0.8B-class hybrid's (24 × 1024, three Gated DeltaNet layers to one attention layer, 16
   heads of 128 × 128, 2 key/value heads of 256 in attention), each with exact attention (every
   key and value, up to the bound) and bounded (4 sinks + a window of 1,024); a LLaMA the size
   of SmolLM2-135M (30 × 576, 3 key/value heads of 64) with its default window (4 + 1,024); a
   Mamba-2 the size of mamba2-130m (24 × 768, d_state 128) and `shakespeare-mamba`'s.
2. Speed, 1 torch thread, random weights of the shipped hybrid's size (6 × 160, exact and
   bounded), and a LLaMA (6 × 160, the same widths) and a Mamba-2 (6 × 160) beside it: prefill
   tokens/s (`lm.consume` of 512 tokens a row) and decode tokens/s (32 greedy steps after
   those 512, the eager step: `next_logits`, argmax, `lm(ids, state)`), at batch 1 and 16,
   each the best of 3, the models alternating.

No target: the figures are for choosing a serving mode. Usage:
python bench/hybrid.py [--write]   (--write: docs/BENCHMARKS.md's section)
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from harness import arguments, publish

import model
from model import LanguageModel, State
from model.checkpoint import build

SECTION = "## 15. Hybrids: state against history, prefill and decode"
HISTORIES = (1_000, 8_000, 32_000)
SHIPPED = dict(
    pattern="rrarra", d_model=160, d_ff=384, n_head=4, n_kv_head=2, head_dim=40, rope_dim=10, n_k_heads=2,
    n_v_heads=4, k_head_dim=40, v_head_dim=40, chunk_size=32, tgt_len=128, tie_weights=True,
)  # fmt: skip
CLASS_08B = dict(
    pattern="rrra" * 6, d_model=1024, d_ff=8, n_head=8, n_kv_head=2, head_dim=256, rope_dim=64, n_k_heads=16,
    n_v_heads=16, k_head_dim=128, v_head_dim=128, vocab_size=258,
)  # fmt: skip
EXACT, BOUNDED = dict(attention="exact", max_context=32_768), dict(attention="bounded", sinks=4, window=1024)
LAYOUTS: dict[str, tuple[str, dict]] = {
    "hybrid 6×160 exact": ("gdn-hybrid", {**SHIPPED, **EXACT}),
    "hybrid 6×160 bounded": ("gdn-hybrid", {**SHIPPED, **BOUNDED}),
    "hybrid 24×1024 exact": ("gdn-hybrid", {**CLASS_08B, **EXACT}),
    "hybrid 24×1024 bounded": ("gdn-hybrid", {**CLASS_08B, **BOUNDED}),
    "LLaMA 30×576 (SmolLM2-135M), 4 + 1,024": (
        "llama",
        dict(n_layer=30, d_model=576, n_head=9, n_kv_head=3, head_dim=64, d_ff=8, sinks=4, window=1024),
    ),
    "Mamba-2 24×768 (mamba2-130m)": ("mamba2", dict(n_layer=24, d_model=768, d_state=128, head_dim=64)),
    "Mamba-2 8×256 (shakespeare-mamba)": ("mamba2", dict(n_layer=8, d_model=256, d_state=32, head_dim=32)),
}
SPEED: dict[str, tuple[str, dict]] = {
    "hybrid exact": ("gdn-hybrid", {**SHIPPED, **EXACT}),
    "hybrid bounded": ("gdn-hybrid", {**SHIPPED, **BOUNDED}),
    "LLaMA 6×160": (
        "llama",
        dict(n_layer=6, d_model=160, n_head=4, n_kv_head=2, head_dim=40, d_ff=384, sinks=4, window=1024),
    ),
    "Mamba-2 6×160": ("mamba2", dict(n_layer=6, d_model=160, d_state=64, head_dim=40, chunk_size=32)),
}


# -- 1. state bytes ---------------------------------------------------------------------------
def state_bytes(family: str, config: dict, history: int) -> int:
    """The bytes of one stream's state after `history` tokens, from the layout alone (the
    model built on the meta device: no weights are made)."""
    cls = model.checkpoint.families()[family]
    with torch.device("meta"):
        lm = cls(cls.config_class(**config))
    tensors = {name: torch.zeros(1, *shape) for name, shape in lm.fixed_shapes().items()}
    for name, axis in lm.time_axes().items():
        tensors[name] = torch.zeros(1, axis.layers, min(history, axis.bound), axis.width)
    tensors["n_tokens"] = torch.tensor([history])
    return len(State(family, "bench", tensors, {}, lm.persistent).to_bytes())


def state_table() -> dict[str, dict[int, int]]:
    return {name: {n: state_bytes(fam, cfg, n) for n in HISTORIES} for name, (fam, cfg) in LAYOUTS.items()}


# -- 2. speed ---------------------------------------------------------------------------------
def best_of(fn: Callable[[], None], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def speed(lm: LanguageModel, batch: int, prompt: int = 512, steps: int = 32) -> dict[str, float]:
    ids = torch.randint(0, 256, (batch, prompt), generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        prefill = best_of(lambda: lm.consume(ids, lm.new_state(batch)))
        _, start = lm.consume(ids, lm.new_state(batch))

        def decode() -> None:
            state = start.clone()
            for _ in range(steps):
                nxt = lm.next_logits(state).argmax(-1, keepdim=True)
                _, state = lm(nxt, state, model.IN_PLACE)

        step = best_of(decode)
    return {"prefill_tokens_per_s": batch * prompt / prefill, "decode_tokens_per_s": batch * steps / step}


def speed_table() -> dict[str, dict[int, dict[str, float]]]:
    torch.manual_seed(0)
    models = {name: build(fam, cfg).eval() for name, (fam, cfg) in SPEED.items()}
    out: dict[str, dict[int, dict[str, float]]] = {name: {} for name in models}
    for batch in (1, 16):
        for name, lm in models.items():  # alternating, one batch size at a time
            out[name][batch] = speed(lm, batch)
    return out


# -- the section ------------------------------------------------------------------------------
def kb(n: int) -> str:
    return f"{n / 1e6:,.2f} MB" if n >= 1e6 else f"{n / 1e3:,.1f} KB"


def section(states: dict[str, dict[int, int]], speeds: dict[str, dict[int, dict[str, float]]]) -> str:
    lines = [
        SECTION,
        "",
        f"Written by `bench/hybrid.py` ({time.strftime('%Y-%m-%d')}, 1 torch thread, on the shared "
        "2-core machine: speeds are side by side in one run, their ratios the figures to read).",
        "",
        "**State bytes against history** (one stream, fp32, as recur's state format writes it; the "
        "recurrent part of a hybrid is one size for ever, its attention part grows with exact "
        "attention and stops at sinks + window with bounded):",
        "",
        "| model, attention | " + " | ".join(f"{n:,} tokens" for n in HISTORIES) + " |",
        "|---|" + "---:|" * len(HISTORIES),
    ]
    lines += [f"| {name} | " + " | ".join(kb(b) for b in row.values()) + " |" for name, row in states.items()]
    lines += [
        "",
        "**Speed** (random weights; prefill of 512 tokens a row, then 32 eager greedy decode steps):",
        "",
        "| model | prefill tok/s, batch 1 | batch 16 | decode tok/s, batch 1 | batch 16 |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in speeds.items():
        cells = [row[b]["prefill_tokens_per_s"] for b in (1, 16)] + [
            row[b]["decode_tokens_per_s"] for b in (1, 16)
        ]
        lines.append(f"| {name} | " + " | ".join(f"{c:,.0f}" for c in cells) + " |")
    lines += ["", "Reproduce: `python bench/hybrid.py` (add `--write` to rewrite this section).", ""]
    return "\n".join(lines)


def main() -> None:
    args = arguments(__doc__ or "").parse_args()
    torch.set_num_threads(1)
    states, speeds = state_table(), speed_table()
    result = {"state_bytes": states, "speed": speeds}
    publish(SECTION, section(states, speeds), result, args.write)


if __name__ == "__main__":
    main()
