"""Int8 weights for CPU inference: `Int8Linear`, what a family's `quantize` puts in place of
its linear layers (`recur serve --precision int8`).

A weight is stored as int8 with one scale per output channel (symmetric: w[o] ~ s[o] q[o],
s[o] = max|w[o]| / 127), a quarter of its fp32 bytes: a decode step, which reads every
weight once, moves a quarter as much. The product runs on the CPU's int8 units
(`torch._int_mm`, exact int32 sums: VNNI / AMX on x86). Its input rows (tokens) are not
rounded to 8 bits: each row is scaled to 14-bit integers, q = round(x / s_x) with
s_x = max|x| / (127 * 128), and split into two int8 halves, q = 128 hi + lo, which go
through one product as twice the rows:

    y[t, o] = s_x[t] s[o] (128 sum_i hi[t, i] q[o, i] + sum_i lo[t, i] q[o, i])

So the only rounding that matters is the weights' (measured in docs/MODEL_CARD.md: a
weight-only int8 quality), while the product runs at int8 speed. Why not torch's
weight-only kernel (`_weight_int8pack_mm`): on the CPUs measured it is 4 (one row) to 24
(16 rows) times slower than the fp32 product; and why not 8-bit inputs (one half only): it
costs several times the perplexity. Rows are scaled one by one and the integer sums are
exact, so a row's result never depends on the rows batched or chunked with it: batching
changes nothing at all, and chunking no more than fp32 rounding elsewhere in the step does
(a last-bit difference can move an input across a rounding step: within 1e-4). A product of
fewer than `MIN_ROWS` rows is padded to them: the int8 kernel picks a much faster path from
there (measured: twice as fast).
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


class Int8Linear(nn.Module):
    """y = x W^T for a bias-free linear layer whose weight W (out, in) is held in int8."""

    weight_t: torch.Tensor
    scale: torch.Tensor

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        q, scale = quantize_rows(weight)
        self.out_features, self.in_features = q.shape
        # (in, out), a transposed view of the rows: the layout `_int_mm` reads fastest
        self.register_buffer("weight_t", q.t(), persistent=False)
        self.register_buffer("scale", scale, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features).float()
        n = rows.shape[0]
        sx = rows.abs().amax(-1, keepdim=True).clamp(min=1e-30) / (127 * HALF)
        q = torch.round(rows / sx)  # 14-bit integers, as floats
        hi = torch.round(q / HALF)
        halves = torch.cat([hi, q - HALF * hi])  # (2n, in): hi rows, then lo rows
        if halves.shape[0] < MIN_ROWS:
            halves = F.pad(halves, (0, 0, 0, MIN_ROWS - halves.shape[0]))
        y = torch._int_mm(halves.to(torch.int8), self.weight_t).float()  # exact integer sums
        y = torch.addcmul(y[n : 2 * n], y[:n], torch.full((), float(HALF)))  # 128 hi + lo
        y = y.mul_(sx).mul_(self.scale)
        return y.view(*lead, self.out_features).to(x.dtype)


def int8_linear(layer: nn.Module) -> Int8Linear:
    """An `nn.Linear` without bias -> its `Int8Linear`."""
    if not isinstance(layer, nn.Linear) or layer.bias is not None:
        raise TypeError("only bias-free nn.Linear layers have an int8 form here")
    return Int8Linear(layer.weight)
