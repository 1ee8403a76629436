"""RL replay (report Sec. 5.3): recomputed log-probs match the sampler's, for both families."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import model
from model.replay import Rollout, replay
from model.sampling import SamplingParams, make_generator, sample

from .conftest import tiny_txl
from .test_rlt import one_thread, tiny_rlt  # noqa: F401  (autouse: one intra-op thread)

SETTINGS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=20),
    SamplingParams(temperature=1.3, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=8, top_p=0.6),
]


def families() -> dict[str, model.LanguageModel]:
    return {"transformer-xl": tiny_txl(), "rlt": tiny_rlt()}


@torch.no_grad()
def generate(
    lm: model.LanguageModel,
    prompt: list[int],
    n: int,
    params: SamplingParams,
    seed: int,
    inserted: dict[int, list[int]] | None = None,
) -> Rollout:
    """What the generate endpoint does: sample from the state, then consume that token once.
    `inserted[i]` tokens (e.g. tool output) are consumed after action i without sampling."""
    _, state = lm.consume(prompt, lm.new_state(1))
    gen = make_generator(seed)
    response: list[int] = []
    mask: list[bool] = []
    mus: list[float | None] = []
    for i in range(n):
        ids, lp = sample(lm.next_logits(state), [params], [gen])
        _, state = lm(ids[None], state)
        response.append(int(ids[0]))
        mask.append(True)
        mus.append(float(lp[0]))
        for tok in (inserted or {}).get(i, []):
            _, state = lm(torch.tensor([[tok]]), state)
            response.append(tok)
            mask.append(False)
            mus.append(None)
    return Rollout(prompt=prompt, response=response, behaviour_logprobs=mus, action_mask=mask)


@pytest.mark.parametrize("family", ["transformer-xl", "rlt"])
@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_ratios_are_one_at_identical_weights(family, params):
    lm = families()[family]
    prompt = lm.tokenizer.encode("ROMEO: wherefore art thou")  # longer than one segment
    rollout = generate(lm, prompt, 25, params, seed=11)
    result = replay(lm, rollout, params)
    assert len(result.ratios) == 25
    assert all(r is not None and abs(r - 1) <= 1e-5 for r in result.ratios), result.ratios
    for lp, mu in zip(result.logprobs, rollout.behaviour_logprobs, strict=True):
        assert lp is not None and mu is not None and abs(lp - mu) <= 1e-5


@pytest.mark.parametrize("family", ["transformer-xl", "rlt"])
def test_inserted_tokens_are_consumed_but_not_scored(family):
    lm = families()[family]
    params = SamplingParams(temperature=0.9)
    rollout = generate(lm, [256, 10, 20], 12, params, seed=3, inserted={2: [65, 66, 67], 7: [68]})
    result = replay(lm, rollout, params)
    for act, lp, r in zip(rollout.action_mask, result.logprobs, result.ratios, strict=True):
        if act:
            assert lp is not None and r is not None and abs(r - 1) <= 1e-5
        else:
            assert lp is None and r is None
    # dropping the inserted tokens changes what later actions were conditioned on
    acts = [i for i, a in enumerate(rollout.action_mask) if a]
    stripped = Rollout(
        prompt=rollout.prompt,
        response=[rollout.response[i] for i in acts],
        behaviour_logprobs=[rollout.behaviour_logprobs[i] for i in acts],
    )
    assert max(abs(r - 1) for r in replay(lm, stripped, params).ratios if r is not None) > 1e-4


@pytest.mark.parametrize("family", ["transformer-xl", "rlt"])
def test_changed_weights_move_the_ratios(family):
    lm = families()[family]
    params = SamplingParams(temperature=1.0)
    rollout = generate(lm, [256, 1, 2, 3], 15, params, seed=5)
    updated = copy.deepcopy(lm)
    with torch.no_grad():
        for p in updated.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ratios = [r for r in replay(updated, rollout, params).ratios if r is not None]
    assert max(abs(math.log(r)) for r in ratios) > 1e-3


def test_a_sampler_setting_mismatch_shows_in_the_ratios():
    lm = tiny_rlt()
    rollout = generate(lm, [256, 5], 20, SamplingParams(temperature=0.7), seed=9)
    ratios = [r for r in replay(lm, rollout, SamplingParams(temperature=1.0)).ratios if r is not None]
    assert max(abs(math.log(r)) for r in ratios) > 1e-3


def test_bad_rollouts_are_refused():
    with pytest.raises(ValueError, match="same length"):
        Rollout(prompt=[1], response=[2, 3], behaviour_logprobs=[-1.0])
    with pytest.raises(ValueError, match="no finite behaviour"):
        Rollout(prompt=[1], response=[2], behaviour_logprobs=[None])
    with pytest.raises(ValueError, match="no finite behaviour"):
        Rollout(prompt=[1], response=[2], behaviour_logprobs=[float("nan")])


@pytest.mark.parametrize("family", ["transformer-xl", "rlt"])
def test_recur_replay_prints_the_ratios(tmp_path, capsys, family):
    from app.cli import main

    lm = families()[family]
    model.save(lm, tmp_path / "m")
    params = SamplingParams(temperature=0.8, top_p=0.95)
    rollout = generate(lm, lm.tokenizer.encode("hello"), 10, params, seed=2)
    obj = {
        "prompt": "hello",
        "response": rollout.response,
        "action_mask": rollout.action_mask,
        "behaviour_logprobs": rollout.behaviour_logprobs,
        "temperature": 0.8,
        "top_p": 0.95,
    }
    (tmp_path / "one.json").write_text(json.dumps(obj))
    (tmp_path / "many.json").write_text(json.dumps([obj, obj]))
    assert main(["replay", str(tmp_path / "m"), str(tmp_path / "one.json")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["ratios"]) == 10 and out["max_abs_log_ratio"] <= 1e-5
    assert main(["replay", str(tmp_path / "m"), str(tmp_path / "many.json")]) == 0
    assert [len(o["ratios"]) for o in json.loads(capsys.readouterr().out)] == [10, 10]
    (tmp_path / "bad.json").write_text(json.dumps({**obj, "behaviour_logprobs": [-1.0]}))
    with pytest.raises(SystemExit, match="recur replay: .*same length"):
        main(["replay", str(tmp_path / "m"), str(tmp_path / "bad.json")])
