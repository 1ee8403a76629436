"""Tiny real models for model-level tests (random weights, deterministic seeds)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import model
from model.checkpoint import build
from model.corpus import shakespeare_works
from model.state import State
from model.train import TrainConfig
from tests.conftest import SSM_TINY
from tests.sensitive import sensitive_model

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


def tiny_ssm(family: str, seed: int = 0, **overrides: object) -> model.LanguageModel:
    """A tiny Mamba or Mamba-2 whose SSM matters (tests/sensitive.py)."""
    return sensitive_model(family, {**SSM_TINY[family], **overrides}, seed)


def tiny_config(out: Path, corpus: Path, **overrides: object) -> TrainConfig:
    """A training run of a dozen steps on a tiny Transformer-XL; `overrides` replace any field."""
    base = dict(
        out=str(out),
        model={**TINY, "mem_len": 16, "tgt_len": 16, "dropout": 0.1},
        corpus=str(corpus),
        batch_size=4,
        steps=12,
        warmup=3,
        lr=3e-3,
        eval_every=6,
        eval_bytes=500,
        ckpt_every=100,
        log_every=3,
        threads=1,
    )
    base.update(overrides)
    return TrainConfig(**base)


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


def logits_with_one_token_changed(
    lm: model.LanguageModel, length: int, j: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of a random stream of `length` tokens fed whole, and of the same stream with
    token `j` changed: for tests of what a position can see."""
    a = torch.randint(0, 258, (1, length), generator=torch.Generator().manual_seed(seed))
    b = a.clone()
    b[0, j] = (a[0, j] + 1) % 258
    with torch.no_grad():
        return lm(a)[0], lm(b)[0]


def assert_any_chunking_agrees(
    lm: model.LanguageModel, length: int, sizes: list[int], seed: int, every_state: bool = False
) -> None:
    """Boundary invariance on two random streams of `length` tokens: fed whole, in chunks of
    `sizes` and one token at a time, the logits agree within 1e-4, and the whole and the
    chunked feeds end in the same state (1e-5, relative too: an SSM's state sums a whole
    history and reaches tens); with `every_state`, the one-token-at-a-time feed's too."""
    tokens = torch.randint(0, 258, (2, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        whole, s_whole = run_chunks(lm, tokens, [length])
        chunked, s_chunked = run_chunks(lm, tokens, sizes)
        one_by_one, s_one = run_chunks(lm, tokens, [1] * length)
    assert (whole - chunked).abs().max().item() <= 1e-4
    assert (whole - one_by_one).abs().max().item() <= 1e-4
    for name, t in s_whole.tensors.items():
        for end in [s_chunked, s_one] if every_state else [s_chunked]:
            assert t.shape == end[name].shape, name
            assert torch.allclose(t.float(), end[name].float(), atol=1e-5), name


@pytest.fixture(scope="module")
def txl() -> model.LanguageModel:
    return tiny_txl()


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    """Seven short works cut from the real corpus: five train, one valid, one test."""
    root = tmp_path_factory.mktemp("corpus")
    works = shakespeare_works()
    for name, text in works[:7]:
        (root / f"{name}.txt").write_text(text[:3000], encoding="utf-8")
    return root


@pytest.fixture
def one_thread():
    """Tiny per-token ops: intra-op threads only add wake-up latency on a shared CPU (a
    module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
