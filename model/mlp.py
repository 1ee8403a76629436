"""The gated MLP that the LLaMA family and the hybrids share (Shazeer, "GLU Variants Improve
Transformer", 2020): down(silu(gate x) * up x), gate and up as one matrix, so a decode step
multiplies a layer's input once, not twice. Nothing here knows a family.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        # nn.Linear, or its int8 form (`model.int8.int8_linear`)
        self.gate_up: nn.Module = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.down: nn.Module = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, -1)  # (B, T, d_ff) each
        return self.down(F.silu(gate) * up)
