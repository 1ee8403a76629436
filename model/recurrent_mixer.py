"""What every recurrent mixer shares, whichever family it serves (Mamba's selective scan in
`model/mamba.py`, Mamba-2's SSD layer in `model/ssd.py`, the Gated DeltaNet in
`model/gdn_hybrid.py`): the interface a block calls, the causal depthwise convolution over
a stream with its window of the last inputs, and the initialisation of Delta's bias.

A recurrent mixer maps (u, conv window, state) to (output, window', state'): its state is a
conv window of d_conv - 1 inputs and a matrix per layer, of one size whatever the history.
A layer module, not a family: it knows no model and no config.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


class SSMMixer(nn.Module):
    """A block's sequence mixer: (u, conv window, h) -> (output, window', h') (`forward`)."""

    out_proj: nn.Linear

    @staticmethod
    def state_shapes(cfg: Any) -> tuple[int, tuple[int, ...]]:
        """(conv channels, one layer's SSM state shape)."""
        raise NotImplementedError

    def reset_ssm(self) -> None:
        """Initialise the SSM's own parameters (after GPT-2's init of the linear layers)."""
        raise NotImplementedError


def causal_conv(x: torch.Tensor, window: torch.Tensor, conv: nn.Conv1d) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal convolution over a stream: x (b, T, C) the new inputs, window
    (b, K-1, C) the K-1 inputs before them (zeros before the stream's start) -> its output
    (b, T, C) and the window after x. y_t = bias + sum_k w_k * x_{t-K+1+k}."""
    K, T = conv.kernel_size[0], x.shape[1]
    xx = torch.cat([window.to(x.dtype), x], 1)  # (b, K-1+T, C)
    w = conv.weight[:, 0]  # (C, K)
    y = xx[:, :T] * w[:, 0] if conv.bias is None else torch.addcmul(conv.bias, xx[:, :T], w[:, 0])
    for k in range(1, K):
        y = torch.addcmul(y, xx[:, k : k + T], w[:, k])
    return y, xx[:, xx.shape[1] - (K - 1) :]


def inverse_softplus(y: torch.Tensor) -> torch.Tensor:
    """x with softplus(x) = y (for y > 0)."""
    return y + torch.log(-torch.expm1(-y))


def init_dt_bias(bias: torch.Tensor, dt_min: float = 1e-3, dt_max: float = 0.1, floor: float = 1e-4) -> None:
    """The paper's Delta init: softplus(bias) log-uniform in [dt_min, dt_max]."""
    with torch.no_grad():
        dt = torch.exp(torch.rand_like(bias) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        bias.copy_(inverse_softplus(dt.clamp(min=floor)))
