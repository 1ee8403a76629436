"""Mamba-2 hybrids (Granite-4.0-H, Bamba's and Nemotron-H's layout): Mamba-2's SSD layers
(`model/ssd.py`) with an attention layer among every few (`model/hybrid.py`), the layer
pattern read from the checkpoint's config.

The recurrent mixer is Mamba-2's (the `mamba2` family's, unchanged): one in-projection to z, x, B, C and Delta, a
causal conv over x, B and C, the SSD recurrence h_t = exp(Delta_t A) h_{t-1} + Delta_t x_t B_t^T
per head, the skip D, RMSNorm(y * silu(z)) per group, the out-projection; a prefill runs SSD's
chunked algorithm and a decode step the recurrence. Granite's muP multipliers (embedding,
residual, attention scale, logits) are `HybridConfig`'s; its attention has no positions
(NoPE: `rope_dim` 0) unless the config asks for RoPE.

Conversion: `model/hf_hybrid.py` reads `granitemoehybrid` directories with dense MLPs (the
shared MLP and no experts).
"""

from __future__ import annotations

from dataclasses import dataclass

from .hybrid import Hybrid, HybridConfig
from .ssd import SSDConfig, SSDMixer


@dataclass
class Mamba2HybridConfig(HybridConfig):
    d_state: int = 16  # N
    expand: int = 2  # the SSD layer's width D = expand * d_model
    ssm_head_dim: int = 16  # P; D / P heads
    n_groups: int = 1  # G: heads in a group share B and C
    chunk_size: int = 64  # SSD's block (results do not depend on it)
    dt_limit: tuple[float, float | None] = (0.0, None)
    conv_bias: bool = True
    ssm_bias: bool = False  # in_proj and out_proj biases

    def __post_init__(self) -> None:
        super().__post_init__()
        self.dt_limit = self.ssd().dt_limit  # checked, and JSON's list made a tuple

    def ssd(self) -> SSDConfig:
        """The recurrent layers' SSD mixer's shape (head_dim is the attention's here)."""
        return SSDConfig.of(self, head_dim=self.ssm_head_dim, bias=self.ssm_bias)


class Mamba2Hybrid(Hybrid):
    family = "mamba2-hybrid"
    config_class = Mamba2HybridConfig
    mixer_class = SSDMixer
