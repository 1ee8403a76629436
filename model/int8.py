"""Int8 weights for CPU inference: `Int8Linear`, what a family's `quantize` puts in place of
its linear layers (`recur serve --precision int8`), and `Int8Embedding`, a token lookup in
the same table (a head tied to the embedding keeps one int8 copy, not a float table too).

A weight is stored as int8 with one scale per output channel (symmetric: w[o] ~ s[o] q[o],
s[o] = max|w[o]| / 127), a quarter of its fp32 bytes: a decode step, which reads every
weight once, moves a quarter as much. Two products, by the number of rows (tokens):

  * below `PACKED_ROWS` (a decode step, a few streams): torch's weight-only kernel
    (`_weight_int8pack_mm`) with the input rows in bfloat16, the only dtype it vectorises on
    CPU (with fp32 inputs it runs a scalar loop, 7x slower than fp32 dense; with bfloat16
    it is 3x faster than fp32 dense at one row). It works a row at a time, so it loses to
    the next from about 8 rows.
  * from `PACKED_ROWS` (prefill chunks, large batches): the CPU's int8 units
    (`torch._int_mm`, exact int32 sums: VNNI / AMX on x86), the input rows not rounded to 8
    bits but scaled to 14-bit integers, q = round(x / s_x), s_x = max|x| / (127 * 128), and
    split into two int8 halves, q = 128 hi + lo, which go through one product as twice the
    rows:

        y[t, o] = s_x[t] s[o] (128 sum_i hi[t, i] q[o, i] + sum_i lo[t, i] q[o, i])

    A product of fewer than `MIN_ROWS` rows is padded to them (the kernel picks a much
    faster path from there). On a CPU without int8 units (no VNNI, no AMX), where `_int_mm`
    is 40x slower than an fp32 GEMM, the rows go instead through an fp32 GEMM with the
    weights dequantized for the call (`model/cpu_gemm.py`).

Both treat every row alone, so a row's result never depends on the rows batched with it
within a regime; across the two it differs by bfloat16's rounding of the input (a chunked
text against the same text token by token: within the boundary tolerance that
tests/model/test_llama.py checks). The weights' rounding is the one that matters (measured
in docs/MODEL_CARD.md).

A packed LLaMA's head and token lookup (`Int8Head`, `Int8Embedding`) are held twice: in
`Int8Blocks`, int8 in blocks of 32 weights with a scale each (GGUF's Q8_0, read from the file
as it is), the exact table, and as the per-row `Int8Linear` that the fast kernels want. The
per-row rounding costs a head far more than it costs a block layer (it sets every logit: on
the shipped Q8_0 head, most of the packed path's greedy disagreement with fp32), so a head
product is the per-row one, then each row's `REFINE` largest logits recomputed from the
exact blocks: the tokens greedy decoding and sampling pick among are scored exactly, at the
price of reading `REFINE` rows of the table. The lookup reads the exact blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_gemm


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> its int8 rows (N, K) and their scales (N,) fp32."""
    scale = w.detach().float().abs().amax(-1).clamp(min=1e-12) / 127
    q = torch.round(w.detach().float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


HALF = 128  # q = HALF * hi + lo: hi in [-127, 127], lo in [-64, 64]
MIN_ROWS = 4
PACKED_ROWS = 8  # below: the weight-only kernel in bfloat16; from here: the exact int8 product
_int8_mm = torch.ops.aten._weight_int8pack_mm.default  # the overload: no lookup a call


class Int8Linear(nn.Module):
    """y = x W^T for a bias-free linear layer whose weight W (out, in) is held in int8."""

    q: torch.Tensor
    scale: torch.Tensor
    scale_bf16: torch.Tensor

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        """q (N, K) int8 rows, scale (N,): w[o] = scale[o] q[o]."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("q", q.to(torch.int8).contiguous(), persistent=False)
        self.register_buffer("scale", scale.float(), persistent=False)
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
        if rows.shape[0] < PACKED_ROWS:  # (a decode step: as few calls around the kernel as can be)
            y = _int8_mm(rows.to(torch.bfloat16), self.q, self.scale_bf16)
        elif cpu_gemm.INT8_GEMM:
            y = self.exact(rows.float())
        else:  # no int8 units: an fp32 GEMM (model/cpu_gemm.py)
            y = rows.float() @ self.dequantized().t()
        return (y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)).to(x.dtype)

    def exact(self, rows: torch.Tensor) -> torch.Tensor:
        """The 14-bit-input product of (n, K) fp32 rows, in fp32."""
        n = rows.shape[0]
        sx = rows.abs().amax(-1, keepdim=True).clamp(min=1e-30) / (127 * HALF)
        q = torch.round(rows / sx)  # 14-bit integers, as floats
        hi = torch.round(q / HALF)
        halves = torch.cat([hi, q - HALF * hi])  # (2n, in): hi rows, then lo rows
        if halves.shape[0] < MIN_ROWS:
            halves = F.pad(halves, (0, 0, 0, MIN_ROWS - halves.shape[0]))
        # (in, out): a transposed view of the rows, the layout `_int_mm` reads fastest
        y = torch._int_mm(halves.to(torch.int8), self.q.t()).float()  # exact integer sums
        y = torch.addcmul(y[n : 2 * n], y[:n], torch.full((), float(HALF)))  # 128 hi + lo
        return y.mul_(sx).mul_(self.scale)

    def dequantized(self) -> torch.Tensor:
        """W (N, K) in fp32, for this call only."""
        return self.q.float().mul_(self.scale[:, None])

    def weight_bytes(self) -> int:
        """Bytes a product reads: the int8 rows and their scales."""
        return self.q.numel() + self.scale.numel() * 4


BLOCK = 32  # weights sharing a scale in `Int8Blocks`: GGUF's Q8_0 block
REFINE = 32  # a head's largest logits per row recomputed from the exact blocks


def quantize_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> int8 (N, K) and scales (N, K/block) fp32, symmetric per block (Q8_0's)."""
    N, K = w.shape
    g = w.detach().float().reshape(N, K // block, block)
    scale = g.abs().amax(-1).clamp(min=1e-12) / 127
    return torch.round(g / scale[..., None]).clamp(-127, 127).to(torch.int8).reshape(N, K), scale


class Int8Blocks(nn.Module):
    """A table (N, K) held as int8 in blocks of `BLOCK` weights, each with its own scale:
    w[n, j] = scale[n, j // BLOCK] q[n, j] (GGUF's Q8_0)."""

    q: torch.Tensor
    scale: torch.Tensor

    def __init__(self, q: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        N, K = q.shape
        if K % BLOCK or scale.shape != (N, K // BLOCK):
            raise ValueError(f"an int8 block table ({N}, {K}) needs (N, K/{BLOCK}) scales")
        self.register_buffer("q", q.to(torch.int8).contiguous(), persistent=False)
        self.register_buffer("scale", scale.float().contiguous(), persistent=False)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` (any shape) in fp32: (*index.shape, K)."""
        K = self.q.shape[1]
        q = self.q[index].float().view(*index.shape, K // BLOCK, BLOCK)
        return (q * self.scale[index].unsqueeze(-1)).view(*index.shape, K)

    def dequantized(self, chunk: int = 4096):
        """The table in fp32, `chunk` rows at a time (an iterator: never whole)."""
        for i in range(0, self.q.shape[0], chunk):
            yield self.rows(torch.arange(i, min(i + chunk, self.q.shape[0])))

    def weight_bytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4


class Int8Head(nn.Module):
    """Logits = x W^T for a head whose exact table is `Int8Blocks`: the per-row int8 product
    (`Int8Linear`, the fast kernels), with each row's `REFINE` largest logits recomputed
    exactly (fp32) from the blocks."""

    def __init__(self, exact: Int8Blocks, refine: int = REFINE):
        super().__init__()
        self.exact, self.refine = exact, refine
        q, scale = zip(*(quantize_rows(w) for w in exact.dequantized()), strict=True)
        self.rows = Int8Linear(torch.cat(q), torch.cat(scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.rows(x).float()
        lead, K = y.shape[:-1], x.shape[-1]
        y, xs = y.reshape(-1, y.shape[-1]), x.reshape(-1, 1, K // BLOCK, BLOCK).float()
        top = y.topk(min(self.refine, y.shape[-1]), -1).indices  # (n, r)
        q = self.exact.q[top].float().view(*top.shape, K // BLOCK, BLOCK)  # (n, r, K/B, B)
        exact = ((q * xs).sum(-1) * self.exact.scale[top]).sum(-1)  # block sums, then scales
        return y.scatter_(-1, top, exact).view(*lead, -1)

    def weight_bytes(self) -> int:
        """Bytes a decode step reads: the per-row table, and `refine` exact rows."""
        return self.rows.weight_bytes() + self.refine * self.exact.weight_bytes() // self.exact.q.shape[0]


class Int8Embedding(nn.Module):
    """Token ids -> rows of an `Int8Blocks` table (the head's, when tied to it), in fp32."""

    def __init__(self, table: Int8Blocks):
        super().__init__()
        self.table = table

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table.rows(tokens)


def int8_linear(layer: nn.Module) -> Int8Linear:
    """An `nn.Linear` without bias -> its `Int8Linear`."""
    if not isinstance(layer, nn.Linear) or layer.bias is not None:
        raise TypeError("only bias-free nn.Linear layers have an int8 form here")
    return Int8Linear(*quantize_rows(layer.weight))
