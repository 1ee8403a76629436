"""Int4 weights for CPU inference: `Int4Linear`, what `Llama.quantize("int4")` and the GGUF
reader's packed read (`model/llama_gguf.py`) put in place of a linear layer
(`recur serve --precision int4`).

A weight is held as 4-bit integers q in [0, 15] in groups of `GROUP` along its input, each
group with a scale and a zero, in torch's int4 layout (gpt-fast's, `_weight_int4pack_mm`):

    w = (q - 8) * scale + zero

GGUF's Q4_1 block (`w = q*d + m` per 32 weights) is this with scale = d, zero = m + 8d, and
Q4_0's (`w = (q - 8)*d`) with zero = 0: a file's blocks are packed as they are, never
expanded to float. The scales are held exactly (`scales`: each group's scale and base,
w = q * scale + base; in fp16 where that holds them all, as a Q4_0 or Q4_1 file's d and m,
else in fp32), so the weights are the file's. A float weight is quantized min-max per group
(`quantize_groups`). 0.5 bytes a weight for the integers, 0.125 for fp16 scales (0.25 for
fp32): a decode step, which reads every weight once, moves a sixth of fp32's bytes.

The product, below `DEQUANT_ROWS` rows (a decode step, a few streams): recur's own kernel
(`model/kernels`, `recur_kernels::int4_mm`), fp32 rows times the packed integers with the
exact scales and fp32 sums, so a layer gives the product of the dequantized weights in fp32
(within fp32's rounding; tests/model/test_kernels.py), 1.2-1.3x faster than torch's int4
kernel at one to four rows and 1.5-1.6x at 16 to 47, a step's weights read from memory
(bench/int4_kernel.py). torch's kernel
(`_weight_int4pack_mm_for_cpu`) takes its activations, scales and output in bfloat16, and
those roundings were what kept the int4 path's greedy tokens from fp32's (0.877 of 50 x 128
against 1.0 now, docs/BENCHMARKS.md); it serves only where recur's kernel is not built (a
CPU without AVX2, a machine without a compiler), with the scales in its own bfloat16 layout
(`scales_zeros`). From `DEQUANT_ROWS` rows (a prefill chunk, many streams) the layer is
dequantized for that call and multiplied by one GEMM: fp32 beside recur's kernel (its
fp32 products, the same numbers as the fp32 path's), bfloat16 beside torch's where the CPU
has the units (`model/cpu_gemm.py`). Each row's result is its own in both regimes, so a
token's logits do not depend on the rows it ran with beyond fp32's (bfloat16's beside
torch's kernel) rounding (tests/model/test_packed.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_gemm, kernels

GROUP = 32  # weights sharing a scale and a zero: GGUF's Q4 block
PAD_N = 64  # output rows are padded to a multiple of every block the kernel packs in
DEQUANT_ROWS = 48  # from this many rows, one dequantized GEMM beats the row-at-a-time kernel
_int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu.default  # the overload: no lookup a call


@functools.cache
def block_rows() -> int:
    """The rows of a block in which torch's CPU kernel packs a weight on this machine: B rows
    of each column k, one byte per row pair, the byte of row d holding rows d (low nibble)
    and d + B/2 (high). B is 64 where the kernel is built for AVX-512 and 32 for AVX2, so it
    is read off the kernel itself: a probe whose every weight holds its own index, 4 bits at
    a time, tells where each weight went."""
    N, K = 2 * PAD_N, 64
    index = torch.arange(N * K).view(N, K)
    where = torch.zeros(N * K // 2, 2, dtype=torch.long)
    for i in range(4):  # (N * K = 2^13 indices: 4 nibbles)
        p = torch.ops.aten._convert_weight_to_int4pack_for_cpu(((index >> 4 * i) & 15).to(torch.int32), 1)
        where |= torch.stack([p.reshape(-1) & 15, p.reshape(-1) >> 4], -1).long() << 4 * i
    for B in (64, 32):
        byte = torch.arange(N * K // 2)
        block, k, d = byte // (K * B // 2), byte // (B // 2) % K, byte % (B // 2)
        expected = torch.stack([(block * B + d) * K + k, (block * B + d + B // 2) * K + k], -1)
        if torch.equal(where, expected):
            return B
    raise RuntimeError(
        "torch's int4 CPU kernel packs weights in a layout recur does not read on this machine "
        f"({torch.backends.cpu.get_cpu_capability()}); serve --precision fp32, bf16 or int8"
    )


def quantize_groups(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) float -> q (N, K) uint8 in [0, 15], scale and zero (N, K/group) fp32, min-max per
    group: the group's minimum is q = 0 and its maximum q = 15."""
    N, K = w.shape
    g = w.detach().float().reshape(N, K // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(N, K), scale, lo + 8 * scale


class Int4Linear(nn.Module):
    """y = x W^T for a bias-free linear layer whose weight W (out, in) is held in int4 groups."""

    packed: torch.Tensor
    scales: torch.Tensor
    scales_zeros: torch.Tensor | None

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int = GROUP):
        """q (N, K) integers in [0, 15]; scale and zero (N, K/group): w = (q - 8) scale + zero."""
        super().__init__()
        N, K = q.shape
        if K % group or scale.shape != (N, K // group) or zero.shape != scale.shape:
            raise ValueError(
                f"an int4 weight ({N}, {K}) needs K a multiple of {group} and (N, K/{group}) scales"
            )
        self.out_features, self.in_features, self.group = N, K, group
        self.kernel = kernels.int4_mm()  # recur's fp32 kernel, or None: torch's bfloat16 one
        pad = -N % PAD_N  # rows of zeros (q = 8, scale = zero = 0), sliced off the output
        q = F.pad(q.to(torch.int32), (0, 0, 0, pad), value=8)
        sz = torch.stack([F.pad(scale.float(), (0, 0, 0, pad)), F.pad(zero.float(), (0, 0, 0, pad))], -1)
        self.register_buffer(
            "packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), persistent=False
        )
        # (N'/B, K/group, 2, B): each block's scales and bases (w = q * scale + base) for recur's
        # kernel and the dequantization, exact as the file or quantizer gave them: fp16 where
        # that holds every one exactly (a Q4_0 or Q4_1 file's d and m), else fp32
        B, Np = block_rows(), N + pad
        base = (sz[..., 1].double() - 8 * sz[..., 0].double()).float()
        scales = torch.stack([sz[..., 0], base], 1).view(Np // B, B, 2, K // group).permute(0, 3, 2, 1)
        if torch.equal(scales.half().float(), scales):  # (a Q4_0 or Q4_1 file's d and m: half the bytes)
            scales = scales.half()
        self.register_buffer("scales", scales.contiguous(), persistent=False)
        # (K/group, N', 2) bfloat16: torch's kernel's layout, where recur's kernel is not built
        self.register_buffer(
            "scales_zeros",
            sz.transpose(0, 1).contiguous().to(torch.bfloat16) if self.kernel is None else None,
            persistent=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        N = self.out_features
        rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        if rows.shape[0] < DEQUANT_ROWS and self.kernel is not None:  # (a decode step: few calls around it)
            if rows.dtype != torch.float32 or not rows.is_contiguous():
                rows = rows.float().contiguous()
            y = self.kernel(rows, self.packed, self.scales)
        elif rows.shape[0] < DEQUANT_ROWS:  # torch's kernel: bfloat16 in and out
            y = _int4_mm(rows.to(torch.bfloat16), self.packed, self.group, self.scales_zeros)
        else:  # one GEMM: fp32 beside recur's kernel, else bfloat16 where the CPU has its units
            dtype = torch.bfloat16 if self.kernel is None and cpu_gemm.BF16_GEMM else torch.float32
            y = rows.to(dtype) @ self.dequantized_t(dtype)
        if y.shape[1] != N:
            y = y[:, :N]
        y = y if x.dim() == 2 else y.view(*x.shape[:-1], N)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def dequantized_t(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W^T (K, N') in `dtype`, from the packed layout (`block_rows`): blocks of B rows,
        each byte of a block's column k holding row d (low nibble) and row d + B/2 (high).
        Each weight is computed in fp32 and rounded to `dtype` once: a bfloat16 GEMM's
        weights round once (a bfloat16 product, q * scale + (zero - 8 scale), would round
        them three times, which costs the many-row product's greedy agreement with fp32
        several times over). A prefill chunk pays this for every layer, so each nibble is
        written straight into its place in W^T, rounded as it is stored, with no fp32 copy
        of W^T built and permuted first (`bench/packed_gemm.py` times it against a copy of
        its bytes and against the product)."""
        K, G, B = self.in_features, self.group, block_rows()
        Nb, h = self.packed.shape[0] // B, B // 2
        p = self.packed.view(Nb, K // G, G, h)
        scale, base = (
            self.scales[:, :, None, 0].float(),
            self.scales[:, :, None, 1].float(),
        )  # (Nb, K/G, 1, B)
        out = torch.empty(K, Nb * B, dtype=dtype, device=p.device)
        blocks = out.view(K // G, G, Nb, B).permute(2, 0, 1, 3)  # (Nb, K/G, G, B), over W^T
        torch.addcmul(base[..., :h], p & 15, scale[..., :h], out=blocks[..., :h])
        torch.addcmul(base[..., h:], p >> 4, scale[..., h:], out=blocks[..., h:])
        return out

    def dequantized(self) -> torch.Tensor:
        """W (N, K) in fp32: what the row-at-a-time kernel multiplies by (tests and
        references: serving never expands it)."""
        return self.dequantized_t()[:, : self.out_features].t()

    def weight_bytes(self) -> int:
        """Bytes a product reads: the packed integers, the scales and the zeros."""
        scales = self.scales if self.scales_zeros is None else self.scales_zeros
        return self.packed.numel() * self.packed.element_size() + scales.numel() * scales.element_size()


def int4_linear(layer: nn.Module, group: int = GROUP) -> Int4Linear:
    """An `nn.Linear` without bias -> its `Int4Linear` (min-max per group of `group`)."""
    if not isinstance(layer, nn.Linear) or layer.bias is not None:
        raise TypeError("only bias-free nn.Linear layers have an int4 form here")
    return Int4Linear(*quantize_groups(layer.weight, group), group=group)
