"""The models the API tests serve can feel their own state (issue 38).

A test that serves a model whose log-probs barely depend on its context cannot see a server
that drops, zeroes or mixes up a session's state: it passes either way. So every checkpoint
a fixture serves is held here to one bar, read from the very files the server loads: zeroing
any one part of its state after some text moves some log-prob of what follows by at least
`MATTERS` (tests/sensitive.py), for each part of the persisted state (through the family's
own rebuild, as a state read from Redis is) and of the live state (as the hot cache and the
batch hold it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import model
from tests.app.test_hybrid_api import HYBRIDS
from tests.conftest import HYBRID_TINY, SSM_TINY, TINY, tiny_model_of
from tests.sensitive import MATTERS, sensitive_model, write_sensitive

FAMILIES = ["transformer-xl", "rlt", "mamba", "mamba2", "gdn-hybrid", "mamba2-hybrid"]


def changes(lm: model.LanguageModel, length: int = 40, cut: int = 20) -> dict[str, float]:
    """For each part of `lm`'s state after `cut` random tokens, the largest change in a
    log-prob of the next token and of the `length - cut` tokens after it when that part is
    zeroed: persisted parts as `rebuild_state` turns them into a live state, live parts as
    they run on and as they are stored (Transformer-XL's live `mem` feeds no attention until
    the state is stored and its keys rebuilt from it)."""
    tokens = torch.randint(0, 258, (1, length), generator=torch.Generator().manual_seed(1))
    tokens %= lm.tokenizer.vocab_size

    def logprobs(state: model.State) -> torch.Tensor:
        first = lm.next_logits(state)[:, None]
        rest, _ = lm(tokens[:, cut:], state)
        return torch.cat([first, rest], 1).log_softmax(-1)

    out = {}
    with torch.no_grad():
        _, state = lm(tokens[:, :cut], lm.new_state(1))
        kept = {name: state[name] for name in lm.persistent}
        base = logprobs(lm.rebuild_state({k: v.clone() for k, v in kept.items()}))
        for name, t in kept.items():
            if t.is_floating_point() and t.numel():  # (an empty part, exact attention's sinks, holds nothing)
                zeroed = {k: torch.zeros_like(v) if k == name else v.clone() for k, v in kept.items()}
                out[f"stored {name}"] = (logprobs(lm.rebuild_state(zeroed)) - base).abs().max().item()
        for name, t in state.tensors.items():
            if t.is_floating_point() and t.numel():
                live = state.clone().replace(**{name: torch.zeros_like(t)})
                stored = lm.rebuild_state({k: live[k].clone() for k in lm.persistent})
                out[f"live {name}"] = max(  # as it runs on, and as the commit stores it
                    (logprobs(live) - base).abs().max().item(),
                    (logprobs(stored) - base).abs().max().item(),
                )
    return out


def assert_state_matters(lm: model.LanguageModel) -> None:
    moved = changes(lm)
    assert moved, "the model has no state to test"
    numb = {part: f"{change:.1e}" for part, change in moved.items() if change < MATTERS}
    assert not numb, f"zeroing these parts of the state moves no log-prob by {MATTERS}: {numb}"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_served_tiny_model_feels_every_part_of_its_state(family, tiny_model_dir, tmp_path_factory):
    """The checkpoints of tests/conftest.py (`tiny_model_dir`, `tiny_model_of`), as served."""
    assert_state_matters(model.load(tiny_model_of(family, tiny_model_dir, tmp_path_factory)))


def test_the_served_tiny_llm_feels_every_part_of_its_state(tiny_gguf: Path):
    """The tiny GGUF LLaMA of tests/app/conftest.py: its window and its sinks."""
    assert_state_matters(model.load(tiny_gguf))


@pytest.mark.parametrize("name", list(HYBRIDS))
def test_the_served_hybrids_feel_every_part_of_their_state(name, tmp_path):
    """The hybrids of tests/app/test_hybrid_api.py, as served (their attention options)."""
    family, options = HYBRIDS[name]
    write_sensitive(tmp_path / "tiny", family=family, seed=0, **HYBRID_TINY[family])
    assert_state_matters(model.load(tmp_path / "tiny", options=options))


def test_a_gpt2_initialised_model_is_caught_as_numb():
    """The bar can fail: the GPT-2 initialisation that the served models had before is numb
    in some part of its state for Transformer-XL and both SSMs."""
    for family, config in [("transformer-xl", TINY), *SSM_TINY.items()]:
        torch.manual_seed(0)
        with pytest.raises(AssertionError, match="moves no log-prob"):
            assert_state_matters(model.build(family, config).eval())


def test_sensitize_makes_every_family_feel_its_state():
    """`sensitive_model`, which tests build their own served checkpoints with."""
    for family, config in [("transformer-xl", TINY), *SSM_TINY.items()]:
        assert_state_matters(sensitive_model(family, config))
