"""Normalisation layers the families share: RMSNorm (Zhang and Sennrich, 2019) as every
family but Transformer-XL normalises.

`RMSNorm` is `nn.RMSNorm` with the parameter name `weight`, so checkpoints written before
this module existed load unchanged; `rms_norm` is its forward as a plain function, which a
family calls on its hot path without a module call. Nothing here knows a family.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm, holding its eps as a tensor for `rms_norm`."""

    eps_tensor: torch.Tensor

    def __init__(self, d: int, eps: float):
        super().__init__(d, eps=eps)
        self.register_buffer("eps_tensor", torch.tensor(eps), persistent=False)

    def reset_buffers(self) -> None:
        """Make eps_tensor again (`LanguageModel.without_init` leaves buffers uninitialised)."""
        self.eps_tensor = torch.tensor(self.eps if self.eps is not None else 0.0, device=self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self)


def rms_norm(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w with mean(x^2) = |x|^2 / d: five small kernels where
    nn.RMSNorm's CPU path runs seven, and no module call (a decode step runs fourteen norms)."""
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return x * torch.rsqrt(torch.addcmul(norm.eps_tensor, n, n, value=1 / x.shape[-1])) * norm.weight
