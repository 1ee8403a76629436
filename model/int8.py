"""Int8 weights for CPU inference: `Int8Linear`, what a family's `quantize` puts in place of
its linear layers (`recur serve --precision int8`).

A weight is stored as int8 with one scale per output channel (symmetric: w[o] ~ s[o] q[o],
s[o] = max|w[o]| / 127), a quarter of its fp32 bytes: a decode step, which reads every
weight once, moves a quarter as much. The product runs on int8 units (`torch._int_mm`, int32
accumulation: VNNI / AMX on x86) with each input row (each token) quantized as it arrives,
with its own scale (s_x = max|x| / 127):

    y[t, o] = s_x[t] s[o] sum_i qx[t, i] q[o, i]

Why not weight-only (int8 weights, float activations, torch's `_weight_int8pack_mm`): on the
CPUs measured it is 3 to 60 times slower than the fp32 product (bench/llm.py prints both),
while this path is several times faster. Rows are quantized one by one and the integer sum
is exact, so a row's result never depends on the rows batched or chunked with it: batching
and boundary invariance hold exactly as in fp32. The cost in quality is measured in
docs/MODEL_CARD.md.
"""

from __future__ import annotations

import torch
from torch import nn


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> its int8 rows (N, K) and their scales (N,) fp32."""
    scale = w.detach().float().abs().amax(-1).clamp(min=1e-12) / 127
    q = torch.round(w.detach().float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


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
        qx, sx = quantize_rows(rows)
        y = torch._int_mm(qx, self.weight_t).float()  # (rows, out) exact integer sums
        y = y.mul_(sx[:, None]).mul_(self.scale)
        return y.view(*lead, self.out_features).to(x.dtype)


def int8_linear(layer: nn.Module) -> Int8Linear:
    """An `nn.Linear` without bias -> its `Int8Linear`."""
    if not isinstance(layer, nn.Linear) or layer.bias is not None:
        raise TypeError("only bias-free nn.Linear layers have an int8 form here")
    return Int8Linear(layer.weight)
