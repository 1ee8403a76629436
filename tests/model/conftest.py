"""Tiny real models for model-level tests (random weights, deterministic seeds)."""

from __future__ import annotations

import pytest
import torch

import model
from model.checkpoint import build
from model.state import State

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


def run_chunks(
    lm: model.LanguageModel,
    tokens: torch.Tensor,
    sizes: list[int],
    state: State | None = None,
    how: model.Execution = model.FUNCTIONAL,
) -> tuple[torch.Tensor, State]:
    """Feed `tokens` (B, T) in chunks of `sizes`: the logits of all of them and the last state."""
    state = state or lm.new_state(tokens.shape[0])
    out, i = [], 0
    for n in sizes:
        logits, state = lm(tokens[:, i : i + n], state, how)
        out.append(logits)
        i += n
    assert i == tokens.shape[1]
    return torch.cat(out, 1), state


@pytest.fixture(scope="module")
def txl() -> model.LanguageModel:
    return tiny_txl()


@pytest.fixture
def one_thread():
    """Tiny per-token ops: intra-op threads only add wake-up latency on a shared CPU (a
    module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
