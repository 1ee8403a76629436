"""Tiny real models for model-level tests (random weights, deterministic seeds)."""

from __future__ import annotations

import pytest
import torch

import model
from model.checkpoint import build

TINY = dict(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, mem_len=8, tgt_len=8, dropout=0.0)


def tiny_txl(seed: int = 0, **overrides: object) -> model.LanguageModel:
    torch.manual_seed(seed)
    lm = build("transformer-xl", {**TINY, **overrides})
    # random biases make the position/content bias terms matter in every test
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if name.endswith(("r_w_bias", "r_r_bias")):
                p.normal_(0, 0.5)
    lm.fingerprint = model.fingerprint(lm)
    return lm.eval()


# tiny Mamba and Mamba-2: chunks of 3 and a serving chunk of 8, so every test crosses both
SSM_TINY: dict[str, dict] = {
    "mamba": dict(n_layer=2, d_model=16, d_state=4, tgt_len=8),
    "mamba2": dict(n_layer=2, d_model=16, d_state=8, head_dim=8, n_groups=2, chunk_size=3, tgt_len=8),
}


def tiny_ssm(family: str, seed: int = 0, **overrides: object) -> model.LanguageModel:
    """A tiny Mamba or Mamba-2 whose SSM matters: weights of unit gain (GPT-2's init makes
    B_t, C_t and the gate tiny), Delta and A spread so that some channels decay within a few
    tokens and some keep the whole stream."""
    torch.manual_seed(seed)
    lm = build(family, {**SSM_TINY[family], **overrides})
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-3.0, 1.0)
            elif name.endswith(("dt_proj.bias", "dt_bias")):
                p.uniform_(-4.0, 1.0)
            elif p.dim() >= 2 and "embeddings" not in name:
                p.normal_(0.0, p[0].numel() ** -0.5)
    lm.fingerprint = model.fingerprint(lm)
    return lm.eval()


@pytest.fixture(scope="module")
def txl() -> model.LanguageModel:
    return tiny_txl()
