"""What the packed layers' many-row products cost on this CPU (model/cpu_gemm.py): one
SmolLM2 MLP-sized product, 512 rows x 576 -> 1536 (a prompt's chunk), in fp32, in bfloat16
and in int8 (`torch._int_mm`), side by side in one run, against the machine's fp32 GEMM rate
measured in the same run (`roofline.gemm_rate`: a square 2048 product); which product
each packed layer takes here; and what an int4 layer of that size pays before its product,
its weights dequantized to the product's dtype (`Int4Linear.dequantized_t`), against a
plain copy of the same bytes."""

from __future__ import annotations

import argparse

import torch
from roofline import best_of, gemm_rate

from model import cpu_gemm
from model.int4 import Int4Linear, quantize_groups


def best_ms(f, rounds: int) -> float:
    f()  # warm-up
    return best_of(f, rounds) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    M, K, N = args.rows, 576, 1536
    x, w = torch.randn(M, K), torch.randn(K, N)
    xi = torch.randint(-127, 128, (M, K), dtype=torch.int8)
    wi = torch.randint(-127, 128, (K, N), dtype=torch.int8)
    xb, wb = x.bfloat16(), w.bfloat16()
    ms = {
        "fp32": best_ms(lambda: x @ w, args.rounds),
        "bfloat16": best_ms(lambda: xb @ wb, args.rounds),
        "int8 (_int_mm)": best_ms(lambda: torch._int_mm(xi, wi), args.rounds),
    }
    flops, limit = 2 * M * K * N, gemm_rate(args.threads)
    print(
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s), {M} x {K} x {N}; "
        f"the machine's fp32 GEMM {limit / 1e9:.1f} GFLOP/s"
    )
    print("| product | ms | GFLOP/s | ÷ the fp32 GEMM rate | ÷ fp32's time |")
    print("|---|---|---|---|---|")
    for name, t in ms.items():
        rate = flops / t * 1e3
        print(f"| {name} | {t:.2f} | {rate / 1e9:.1f} | {rate / limit:.0%} | {t / ms['fp32']:.1f}x |")
    print(
        f"int4 prefill takes the {'bfloat16' if cpu_gemm.BF16_GEMM else 'fp32'} GEMM here; "
        f"int8 prefill the {'int8' if cpu_gemm.INT8_GEMM else 'fp32'} one"
    )
    dtype = torch.bfloat16 if cpu_gemm.BF16_GEMM else torch.float32
    layer = Int4Linear(*quantize_groups(torch.randn(N, K)))
    src = layer.dequantized_t(dtype)
    dst = torch.empty_like(src)
    deq = best_ms(lambda: layer.dequantized_t(dtype), args.rounds)
    copy = best_ms(lambda: dst.copy_(src), args.rounds)
    gemm = ms["bfloat16" if cpu_gemm.BF16_GEMM else "fp32"]
    print(
        f"int4 dequantization of that layer to {dtype}: {deq:.3f} ms, {deq / copy:.1f}x a copy of its "
        f"{src.numel() * src.element_size() / 1e6:.2f} MB ({copy:.3f} ms), {deq / gemm:.0%} of the product's time"
    )


if __name__ == "__main__":
    main()
