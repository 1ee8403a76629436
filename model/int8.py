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
    faster path from there).

Both treat every row alone, so a row's result never depends on the rows batched with it
within a regime; across the two it differs by bfloat16's rounding of the input (a chunked
text against the same text token by token: within the boundary tolerance that
tests/model/test_llama.py checks). The weights' rounding is the one that matters (measured
in docs/MODEL_CARD.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> its int8 rows (N, K) and their scales (N,) fp32."""
    scale = w.detach().float().abs().amax(-1).clamp(min=1e-12) / 127
    q = torch.round(w.detach().float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


HALF = 128  # q = HALF * hi + lo: hi in [-127, 127], lo in [-64, 64]
MIN_ROWS = 4
PACKED_ROWS = 8  # below: the weight-only kernel in bfloat16; from here: the exact int8 product


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
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] < PACKED_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(rows.to(torch.bfloat16), self.q, self.scale_bf16)
        else:
            y = self.exact(rows.float())
        return y.view(*lead, self.out_features).to(x.dtype)

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

    def weight_bytes(self) -> int:
        """Bytes a product reads: the int8 rows and their scales."""
        return self.q.numel() + self.scale.numel() * 4


class Int8Embedding(nn.Module):
    """Token ids -> rows of an `Int8Linear`'s weight (a head tied to the embedding), in fp32."""

    def __init__(self, table: Int8Linear):
        super().__init__()
        self.table = table

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table.q[tokens].float() * self.table.scale[tokens].unsqueeze(-1)


def int8_linear(layer: nn.Module) -> Int8Linear:
    """An `nn.Linear` without bias -> its `Int8Linear`."""
    if not isinstance(layer, nn.Linear) or layer.bias is not None:
        raise TypeError("only bias-free nn.Linear layers have an int8 form here")
    return Int8Linear(*quantize_rows(layer.weight))
