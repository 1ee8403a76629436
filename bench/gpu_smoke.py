"""GPU smoke test: correctness on the device, then decode throughput. Under 5 minutes.

Checks (each prints PASS/FAIL and the figure):
  * chunk invariance on the GPU in fp32 (one call vs token by token), max |Δlogit| ≤ 1e-4;
  * a batch of streams equals each stream alone;
  * bf16 autocast against fp32: max |Δ log-prob| (reported; bf16 is not exact);
  * state bytes round trip through pinned host memory;
  * the compiled (Inductor) decode step equals the eager one.
  * GPU fp32 logits equal the CPU's within 1e-3 (the same weights and tokens).
Each check runs for every model of `--models`: the shipped byte-level Transformer-XL, the
shipped assistant (smollm2, a LLaMA-architecture LLM served as sinks + window state), and a
Mamba and a Mamba-2 the shape of the published 130M checkpoints (`mamba`, `mamba2`: random
weights); with `--small`, tiny random models of the last three's families, so that a dry run
covers their code paths.
Throughput: greedy decode tokens/s at batch 1, 16, 64 and 256, with the bandwidth achieved
(bytes of weights + state read per step × steps/s), gpt-fast style; batch 256 of the
shipped `shakespeare` against the 20,000 tokens/s target.
Roofline: a WikiText-103-size Transformer-XL (18 layers × 1024, mem 1600, random weights)
at batch 1, eager and as a CUDA graph (torch.compile, reduce-overhead): bandwidth achieved
÷ the device's HBM peak (`--hbm-gbs`, H200: 4,800 GB/s), against the 60% target.
Usage: python bench/gpu_smoke.py [--models shakespeare,smollm2,mamba,mamba2] [--hbm-gbs 4800]
       python bench/gpu_smoke.py --device cpu --small    (a dry run of every code path)
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import torch

import model
from model import IN_PLACE, LanguageModel, State
from model.checkpoint import build, packaged

BATCH_256_TARGET = 20_000  # tokens/s, the shipped model at batch 256 (issue 14)
HBM_TARGET = 0.60  # bandwidth achieved ÷ HBM peak, WikiText-103-size model at batch 1
# --small: the LLM family's code paths on a tiny random model (sinks and window overrun)
TINY_LLAMA = dict(
    n_layer=2, d_model=64, n_head=4, n_kv_head=2, head_dim=16, d_ff=128, sinks=4, window=60, tgt_len=32
)

# SmolLM2-135M-Instruct's shape (model.load("smollm2").config), for random weights
SMOLLM2_SHAPE = dict(
    vocab_size=49152,
    n_layer=30,
    d_model=576,
    n_head=9,
    n_kv_head=3,
    head_dim=64,
    d_ff=1536,
    rope_base=100000.0,
    norm_eps=1e-5,
    tie_weights=True,
    sinks=4,
    window=1024,
    tgt_len=256,
)
FULL = 1100  # tokens that fill every family's state here (SmolLM2: 4 sinks + 1,024 window)

# Mamba and Mamba-2 the shape of the published 130M checkpoints (random weights), or tiny
SSM_SIZES = {
    "mamba": dict(vocab_size=50280, n_layer=24, d_model=768, d_state=16),
    "mamba2": dict(vocab_size=50288, n_layer=24, d_model=768, d_state=128, head_dim=64, chunk_size=256),
}
SSM_SMALL = {
    "mamba": dict(n_layer=2, d_model=64, d_state=8),
    "mamba2": dict(n_layer=2, d_model=64, d_state=16, head_dim=16, n_groups=2, chunk_size=16),
}


def load(name: str, dev: str, small: bool) -> LanguageModel:
    """The model `name` names (random ones seeded, so that two loads hold the same weights)."""
    if name in SSM_SIZES:
        torch.manual_seed(0)
        size = (SSM_SMALL if small else SSM_SIZES)[name]
        return build(name, {**size, "tgt_len": 128, "tie_weights": True}).to(dev).eval()
    if name == "smollm2" and (small or packaged("smollm2") is None):
        # without its GGUF (98 MB: more than a lent GPU machine takes along), its shape
        torch.manual_seed(0)
        if not small:
            print("smollm2: the packaged GGUF is absent here; random weights of its shape", flush=True)
        return build("llama", TINY_LLAMA if small else SMOLLM2_SHAPE).to(dev).eval()
    return model.load(name, device=dev, precision="fp32")


def check(name: str, ok: bool, figure: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {figure}", flush=True)
    return ok


@torch.no_grad()
def correctness(lm: LanguageModel, cpu_lm: LanguageModel, dev: str) -> tuple[bool, list[State]]:
    """Chunk invariance, the device against the CPU, batched against alone, bf16 (reported),
    and the state's bytes round trip; and the three states (5, 50, 300 tokens) they used."""
    ok = True
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, 3 * lm.segment_len), generator=g).to(dev)
    cpu_logits, _ = cpu_lm(x.cpu(), None)
    whole, _ = lm(x, lm.new_state(2))
    st, parts = lm.new_state(2), []
    for t in range(x.shape[1]):
        logits, st = lm(x[:, t : t + 1], st)
        parts.append(logits)
    d = (whole - torch.cat(parts, 1)).abs().max().item()
    ok &= check("chunk invariance fp32", d <= 1e-4, f"max |Δlogit| {d:.2e}")
    d = (whole.cpu() - cpu_logits).abs().max().item()
    ok &= check("device fp32 == CPU fp32", d <= 1e-3, f"max |Δlogit| {d:.2e}")

    states = []
    for n in (5, 50, 300):
        s = lm.new_state(1)
        _, s = lm.consume(torch.randint(0, 256, (n,), generator=g), s)
        states.append(s)
    nxt = torch.randint(0, 256, (3, 8), generator=g).to(dev)
    batched, _ = lm(nxt, lm.stack_states(states))
    alone = torch.cat([lm(nxt[i : i + 1], s)[0] for i, s in enumerate(states)])
    d = (batched - alone).abs().max().item()
    ok &= check("batched == alone", d <= 1e-4, f"max |Δlogit| {d:.2e}")

    lm.precision = "bf16"
    lp16 = torch.log_softmax(lm(x, lm.new_state(2))[0], -1)
    lm.precision = "fp32"
    d = (lp16 - torch.log_softmax(whole, -1)).abs().max().item()
    check("bf16 autocast vs fp32 (report)", True, f"max |Δ log-prob| {d:.3f}")

    blob = states[2].to_bytes()
    back = lm.load_state(blob)
    d = (lm.next_logits(back) - lm.next_logits(states[2])).abs().max().item()
    ok &= check("state bytes round trip (pinned)", d <= 1e-5, f"{len(blob)} bytes, max |Δ| {d:.2e}")
    return ok, states


@torch.no_grad()
def compiled_matches_eager(lm: LanguageModel, state: State, dev: str) -> bool:
    """The compiled decode step against the eager one, 16 greedy steps."""
    # (forward's default: the state built functionally, as the engine compiles it). Inductor's
    # kernels without CUDA graphs: a functional state keeps tensors of the steps before it
    # (the sinks), which a graph's next replay overwrites
    step = torch.compile(lm.forward, dynamic=True)
    tok = torch.zeros(1, 1, dtype=torch.long, device=dev)
    s_e = s_c = state
    diffs = []
    for _ in range(16):
        le, s_e = lm(tok, s_e, IN_PLACE)
        lc, s_c = step(tok, s_c)
        diffs.append((le - lc).abs().max().item())
        tok = le[:, -1:].argmax(-1)
    return check("compiled decode == eager", max(diffs) <= 1e-3, f"max |Δlogit| {max(diffs):.2e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="shakespeare,smollm2,mamba,mamba2")
    ap.add_argument("--hbm-gbs", type=float, default=4800.0, help="the device's HBM peak, GB/s (H200: 4,800)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only for a dry run of the code paths")
    ap.add_argument("--small", action="store_true", help="a small roofline model (dry runs)")
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps a figure (default 50, eager decode twice that; --small: 5, a dry run needs\n"
        "the code paths, not the figures: CPU bf16 at batch 256 took minutes of a CI run)",
    )
    args = ap.parse_args()
    dev = args.device
    steps = args.steps or (5 if args.small else 50)
    if dev == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this script is for GPU hosts (see docs/BENCHMARKS.md)")
        return 2
    print(
        torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)",
        "torch",
        torch.__version__,
        flush=True,
    )
    ok = True
    for name in args.models.split(","):
        print(f"-- {name}", flush=True)
        ok &= smoke(name, dev, args.small, args.hbm_gbs, steps)
    ok &= roofline(dev, args.hbm_gbs, args.small, steps)
    return 0 if ok else 1


def smoke(name: str, dev: str, small: bool, hbm_gbs: float, steps: int) -> bool:
    """Every correctness check and the throughput sweep for one model."""
    lm = load(name, dev, small)
    ok, states = correctness(lm, load(name, "cpu", small), dev)
    ok &= compiled_matches_eager(lm, states[1], dev)
    batch_256 = throughput(lm, states[2], dev, 2 * steps)
    try:
        compiled_throughput(lm, dev, hbm_gbs, steps)
    except Exception as exc:  # (a figure, not a check: the sweep goes on to the next model)
        print(
            f"compiled throughput failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True
        )
    if name == "shakespeare":
        ok &= check(
            "shipped model, batch 256",
            batch_256 >= BATCH_256_TARGET,
            f"{batch_256:,.0f} tokens/s (target {BATCH_256_TARGET:,})",
        )
    return ok


@torch.no_grad()
def compiled_throughput(lm: LanguageModel, dev: str, hbm_gbs: float, steps: int) -> None:
    """The compiled decode step (Inductor's kernels) at batch 1 and 16, fp32 and bf16, its
    state full (a constant shape: one graph): tokens/s, and the bytes it reads (weights and
    state) per second ÷ the HBM peak."""
    full = lm.new_state(1)
    _, full = lm.consume(torch.randint(0, 256, (FULL,), generator=torch.Generator().manual_seed(1)), full)
    step = torch.compile(lm.forward, dynamic=False)  # (no CUDA graphs: compiled_matches_eager says why)
    for precision in ("fp32", "bf16"):
        lm.precision = precision
        weights = sum(p.numel() * p.element_size() for p in lm.parameters())
        for batch in (1, 16):
            dt, st = timed_greedy(step, lm.stack_states([full] * batch), steps, dev)
            per_step = weights + st.nbytes()
            achieved = per_step * steps / dt / 1e9
            print(
                f"compiled {precision} batch {batch:3d}, state full: {batch * steps / dt:9.0f} tokens/s   "
                f"{per_step / 1e6:7.0f} MB/step   {achieved:7.0f} GB/s = {achieved / hbm_gbs:.0%} of HBM",
                flush=True,
            )
    lm.precision = "fp32"


def timed_greedy(step, state: State, steps: int, dev: str) -> tuple[float, State]:
    """Seconds for `steps` greedy decode steps of `step` (tokens, state) -> (logits, state)
    from `state`, after 5 untimed ones, and the state they end in."""
    st, tok = state, torch.zeros(state.batch_size, 1, dtype=torch.long, device=dev)
    for _ in range(5):
        _, st = step(tok, st)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        logits, st = step(tok, st)
        tok = logits[:, -1:].argmax(-1)
    sync(dev)
    return time.perf_counter() - t0, st


def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


@torch.no_grad()
def throughput(lm, state, dev: str, steps: int) -> float:
    """Greedy decode tokens/s at batch 1, 16, 64 and 256, fp32 and bf16, printed; returns
    fp32 batch 256's."""
    weights = sum(p.numel() * p.element_size() for p in lm.parameters())
    out = 0.0
    for precision in ("fp32", "bf16"):
        lm.precision = precision
        for batch in (1, 16, 64, 256):
            st = lm.stack_states([state] * batch)
            tok = torch.zeros(batch, 1, dtype=torch.long, device=dev)
            for _ in range(5):
                _, st = lm(tok, st, IN_PLACE)
            sync(dev)
            t0 = time.perf_counter()
            for _ in range(steps):
                logits = lm.next_logits(st)
                tok = logits.argmax(-1, keepdim=True)
                _, st = lm(tok, st, IN_PLACE)
            sync(dev)
            dt = time.perf_counter() - t0
            per_step_bytes = weights + st.nbytes()
            print(
                f"decode {precision} batch {batch:4d}: {batch * steps / dt:10.0f} tokens/s   "
                f"{steps / dt:7.1f} steps/s   {per_step_bytes * steps / dt / 1e9:6.1f} GB/s achieved",
                flush=True,
            )
            if precision == "fp32" and batch == 256:
                out = batch * steps / dt
    lm.precision = "fp32"
    return out


@torch.no_grad()
def roofline(dev: str, hbm_gbs: float, small: bool, steps: int) -> bool:
    """A WikiText-103-size Transformer-XL (random weights) at batch 1, its memory full:
    bandwidth achieved (weights + the key/value state each step reads) ÷ HBM peak, eager
    and as a CUDA graph."""
    torch.manual_seed(0)
    size = (
        dict(n_layer=2, d_model=64, n_head=2, d_head=32, d_inner=256, mem_len=64)
        if small
        else dict(n_layer=18, d_model=1024, n_head=16, d_head=64, d_inner=4096, mem_len=1600)
    )
    lm = build("transformer-xl", {**size, "tgt_len": 128, "dropout": 0.0}).to(dev).eval()
    state = lm.new_state(1)
    _, state = lm.consume(torch.randint(0, 256, (size["mem_len"] + 1,)), state)
    weights = sum(p.numel() * p.element_size() for p in lm.parameters())
    per_step = weights + state.nbytes()  # every weight, and the memory's keys and values
    best = 0.0
    for name in ("eager", "cuda graph"):
        step = (
            functools.partial(lm.forward, how=IN_PLACE)
            if name == "eager"
            else torch.compile(
                lm.forward, dynamic=True, mode="reduce-overhead" if dev == "cuda" else "default"
            )
        )
        dt, _ = timed_greedy(step, state, steps, dev)
        achieved = per_step * steps / dt / 1e9
        best = max(best, achieved / hbm_gbs)
        print(
            f"roofline {name}: {per_step / 1e6:.0f} MB/step, {achieved:,.0f} GB/s = {achieved / hbm_gbs:.0%} of HBM",
            flush=True,
        )
    return check(
        "WikiText-103-size model, batch 1, bandwidth ÷ HBM peak",
        best >= HBM_TARGET,
        f"{best:.0%} (target {HBM_TARGET:.0%})",
    )


if __name__ == "__main__":
    sys.exit(main())
