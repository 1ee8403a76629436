"""GPU smoke test: correctness on the device, then decode throughput. Under 5 minutes.

Checks (each prints PASS/FAIL and the figure):
  * chunk invariance on the GPU in fp32 (one call vs token by token), max |Δlogit| ≤ 1e-4;
  * a batch of streams equals each stream alone;
  * bf16 autocast against fp32: max |Δ log-prob| (reported; bf16 is not exact);
  * state bytes round trip through pinned host memory;
  * the compiled (CUDA-graph) decode step equals the eager one.
Throughput: greedy decode tokens/s at batch 1, 16, 64 and 256, with the bandwidth achieved
(bytes of weights + state read per step × steps/s), gpt-fast style.
Usage: python bench/gpu_smoke.py [--model shakespeare]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import model


def check(name: str, ok: bool, figure: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'}  {name}: {figure}", flush=True)
    return ok


@torch.no_grad()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="shakespeare")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: this script is for GPU hosts (see docs/BENCHMARKS.md)")
        return 2
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    lm = model.load(args.model, device="cuda", precision="fp32")
    ok = True
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (2, 3 * lm.segment_len), generator=g).cuda()
    whole, _ = lm(x, lm.new_state(2))
    st, parts = lm.new_state(2), []
    for t in range(x.shape[1]):
        logits, st = lm(x[:, t : t + 1], st)
        parts.append(logits)
    d = (whole - torch.cat(parts, 1)).abs().max().item()
    ok &= check("chunk invariance fp32", d <= 1e-4, f"max |Δlogit| {d:.2e}")

    states = []
    for n in (5, 50, 300):
        s = lm.new_state(1)
        _, s = lm.consume(torch.randint(0, 256, (n,), generator=g), s)
        states.append(s)
    nxt = torch.randint(0, 256, (3, 8), generator=g).cuda()
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

    lm.append_in_place = False  # as the engine runs a compiled step: state built functionally
    step = torch.compile(lm.forward, dynamic=True, mode="reduce-overhead")
    tok = torch.zeros(1, 1, dtype=torch.long, device="cuda")
    s_e = s_c = states[1]
    diffs = []
    for _ in range(16):
        le, s_e = lm(tok, s_e)
        lc, s_c = step(tok, s_c)
        diffs.append((le - lc).abs().max().item())
        tok = le[:, -1:].argmax(-1)
    ok &= check("compiled decode == eager", max(diffs) <= 1e-3, f"max |Δlogit| {max(diffs):.2e}")
    lm.append_in_place = True

    weights = sum(p.numel() * p.element_size() for p in lm.parameters())
    for precision in ("fp32", "bf16"):
        lm.precision = precision
        for batch in (1, 16, 64, 256):
            st = lm.stack_states([states[2]] * batch)
            tok = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
            for _ in range(5):
                _, st = lm(tok, st)
            torch.cuda.synchronize()
            steps, t0 = 100, time.perf_counter()
            for _ in range(steps):
                logits = lm.next_logits(st)
                tok = logits.argmax(-1, keepdim=True)
                _, st = lm(tok, st)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            per_step_bytes = weights + st.nbytes()
            print(
                f"decode {precision} batch {batch:4d}: {batch * steps / dt:10.0f} tokens/s   "
                f"{steps / dt:7.1f} steps/s   {per_step_bytes * steps / dt / 1e9:6.1f} GB/s achieved",
                flush=True,
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
