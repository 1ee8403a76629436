"""recur's int4 kernel (model/kernels, `recur_kernels::int4_mm`: fp32 rows, fp32 scales, fp32
sums) against torch's (`_weight_int4pack_mm_for_cpu`: bfloat16 rows, scales and output) on
the same packed weights, side by side in one run: one SmolLM2 layer's four products
(q, k and v joined 576 -> 960, the output 576 -> 576, gate and up joined 576 -> 3072, down
1536 -> 576) at the row counts a decode step and a few streams send, at each thread count,
against the machine's streaming read rate measured in the same run (`roofline.read_bandwidth`)
and each product's error against the float64 product of the same weights.

    python bench/int4_kernel.py [--threads 1,2] [--rows 1,2,4,16,47]
"""

from __future__ import annotations

import argparse

import torch
from roofline import best_of, read_bandwidth

from model import kernels
from model.int4 import Int4Linear, quantize_groups

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): one SmolLM2 layer


def torch_scales(layer: Int4Linear) -> torch.Tensor:
    """The layer's fp32 scales and bases in torch's kernel's layout: (K/32, N', 2) bfloat16
    scales and zeros (zero = base + 8 scale)."""
    s = layer.scales  # (N'/B, K/32, 2, B)
    scale, base = s[:, :, 0].permute(1, 0, 2).flatten(1), s[:, :, 1].permute(1, 0, 2).flatten(1)
    return torch.stack([scale, base + 8 * scale], -1).bfloat16().contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rows", default="1,2,4,16,47")
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    ours = kernels.int4_mm()
    assert ours is not None, "recur's kernel is not built on this machine"
    torch.manual_seed(0)
    layers = [Int4Linear(*quantize_groups(torch.randn(n, k) * 0.02)) for n, k in SHAPES]
    sz = [torch_scales(layer) for layer in layers]
    nbytes = sum(layer.packed.numel() for layer in layers)  # the integers each product reads
    print(
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, recur's kernel "
        f"{'AVX-512' if kernels.AVX512 else 'AVX2'}; one layer's four products, {nbytes / 1e6:.2f} MB of int4 "
        "integers (the scales beside them: fp32 for recur's, bfloat16 for torch's)"
    )
    print(
        "| threads | rows | torch's kernel, µs | recur's, µs | torch's ÷ recur's time | recur's GB/s of integers | ÷ the read rate | max error, torch's / recur's |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        limit = read_bandwidth(threads)
        torch.set_num_threads(threads)
        for rows in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(rows, k) for _, k in SHAPES]
            xb = [x.bfloat16() for x in xs]

            def theirs(xb: list[torch.Tensor] = xb) -> list[torch.Tensor]:
                return [
                    torch.ops.aten._weight_int4pack_mm_for_cpu(x, lay.packed, 32, s)
                    for x, lay, s in zip(xb, layers, sz, strict=True)
                ]

            def recur(xs: list[torch.Tensor] = xs) -> list[torch.Tensor]:
                return [
                    ours(x, lay.packed, lay.scales, kernels.AVX512) for x, lay in zip(xs, layers, strict=True)
                ]

            errors = []
            for got in (theirs(), recur()):
                worst = 0.0
                for x, lay, y in zip(xs, layers, got, strict=True):
                    ref = x.double() @ lay.dequantized().double().t()
                    y = y[:, : lay.out_features].double()
                    worst = max(worst, ((y - ref).abs().max() / ref.abs().max()).item())
                errors.append(worst)
            for f in (theirs, recur):
                f()  # warm-up
            t_theirs = best_of(lambda: [theirs() for _ in range(args.reps)], 3) / args.reps
            t_ours = best_of(lambda: [recur() for _ in range(args.reps)], 3) / args.reps
            rate = nbytes / t_ours
            print(
                f"| {threads} | {rows} | {t_theirs * 1e6:.0f} | {t_ours * 1e6:.0f} | {t_theirs / t_ours:.2f}x | "
                f"{rate / 1e9:.1f} | {rate / limit:.0%} | {errors[0]:.1e} / {errors[1]:.1e} |",
                flush=True,
            )
        print(f"(the machine's streaming read at {threads} thread(s): {limit / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
