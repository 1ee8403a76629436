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
        """Every layer's SSD mixer's shape: the fields of the same names."""
        return SSDConfig.of(self)


class Mamba2(Mamba):
    """Mamba's block, model and state around the SSD mixer."""

    family = "mamba2"
    config_class = Mamba2Config
    mixer_class = SSDMixer
