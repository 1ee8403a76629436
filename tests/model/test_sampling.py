"""Sampling: per-row parameters, seeded determinism, and behaviour log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from model.sampling import SamplingParams, make_generator, sample


def test_greedy_is_argmax_with_model_logprob():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    ids, lp = sample(logits, [SamplingParams(0.0)] * 4, [make_generator(0)] * 4)
    assert torch.equal(ids, logits.argmax(-1))
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(1, ids[:, None])[:, 0])


def test_seeded_sampling_is_deterministic_per_row():
    logits = torch.randn(3, 50)
    params = [SamplingParams(1.0), SamplingParams(0.7, top_k=5), SamplingParams(1.3, top_p=0.9)]
    a = [sample(logits, params, [make_generator(s) for s in (1, 2, 3)])[0] for _ in range(2)]
    assert torch.equal(a[0], a[1])


def test_top_k_and_top_p_restrict_support_and_logprob_is_renormalised():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    seen = set()
    g = make_generator(0)
    for _ in range(300):
        ids, lp = sample(logits, [SamplingParams(1.0, top_k=2)], [g])
        seen.add(int(ids))
        kept = torch.log_softmax(logits[0, :2], -1)
        assert math.isclose(float(lp), float(kept[int(ids)]), rel_tol=1e-5)
    assert seen == {0, 1}
    probs = torch.softmax(logits[0], -1)  # 0.64, 0.24, ...: top_p 0.7 keeps two
    seen = {int(sample(logits, [SamplingParams(1.0, top_p=0.7)], [g])[0]) for _ in range(300)}
    assert seen == {0, 1} and probs[0] < 0.7 < probs[0] + probs[1]


def test_mixed_parameters_in_one_batch_match_running_alone():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(0.0), SamplingParams(0.8, top_k=7), SamplingParams(1.0, top_p=0.5)]
    ids, lp = sample(logits, params, [make_generator(s) for s in (5, 6, 7)])
    for i, (p, s) in enumerate(zip(params, (5, 6, 7), strict=True)):
        one, one_lp = sample(logits[i : i + 1], [p], [make_generator(s)])
        assert int(one) == int(ids[i]) and math.isclose(float(one_lp), float(lp[i]), rel_tol=1e-6)


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)])
def test_invalid_parameters(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)
