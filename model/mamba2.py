"""Mamba-2 (Dao and Gu, 2024): Mamba's block and model (`model/mamba.py`) around the SSD
layer (`model/ssd.py`: the chunked algorithm, the gated norm, the mixer; its notation).

Every layer is a pre-norm residual block around one SSD mixer; the model ends with RMSNorm
and a head, tied to the embedding or not. Parameter names are HF `Mamba2ForCausalLM`'s
without its "backbone." prefix (`model/hf_ssm.py` converts by a rename).

State: as Mamba's, with ssm [b, L, H, P, N].
"""

from __future__ import annotations

from dataclasses import dataclass

from .mamba import Mamba, SSMConfig
from .ssd import SSDConfig, SSDMixer


@dataclass
class Mamba2Config(SSMConfig):
    d_state: int = 64  # N
    head_dim: int = 32  # P; H = expand * d_model / P heads
    n_groups: int = 1  # G: heads in a group share B and C
    chunk_size: int = 64  # SSD's block length (results do not depend on it)
    dt_limit: tuple[float, float | None] = (0.0, None)  # Delta is clamped into it (None: no upper bound)
    tie_weights: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.dt_limit = self.ssd().dt_limit  # checked, and JSON's list made a tuple

    def ssd(self) -> SSDConfig:
        """Every layer's SSD mixer's shape."""
        return SSDConfig(
            d_model=self.d_model,
            d_state=self.d_state,
            d_conv=self.d_conv,
            expand=self.expand,
            head_dim=self.head_dim,
            n_groups=self.n_groups,
            chunk_size=self.chunk_size,
            dt_limit=self.dt_limit,
            bias=self.bias,
            conv_bias=self.conv_bias,
            norm_eps=self.norm_eps,
        )


class Mamba2Mixer(SSDMixer):
    """The SSD mixer, built from the family's config (as Mamba's model builds its mixers)."""

    def __init__(self, cfg: Mamba2Config):
        super().__init__(cfg.ssd())

    @staticmethod
    def state_shapes(cfg: Mamba2Config) -> tuple[int, tuple[int, ...]]:  # type: ignore[override]
        return SSDMixer.state_shapes(cfg.ssd())


class Mamba2(Mamba):
    """Mamba's block, model and state around the SSD mixer."""

    family = "mamba2"
    config_class = Mamba2Config
    mixer_class = Mamba2Mixer
