"""RL replay (report Sec. 5.3): recomputed log-probs match the sampler's, for both families."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import numpy as np
import pytest
import torch

import model
from model.replay import Rollout, replay, replay_transcript, transcript_rollout
from model.replay import report as replay_report
from model.sampling import Context, SamplingParams, make_generator, sample

from .conftest import tiny_ssm, tiny_txl
from .test_rlt import tiny_rlt

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, top_k=20),
    SamplingParams(temperature=1.3, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=8, top_p=0.6),
]


FAMILIES = ["transformer-xl", "rlt", "mamba", "mamba2"]


def families() -> dict[str, model.LanguageModel]:
    return {"transformer-xl": tiny_txl(), "rlt": tiny_rlt(), "mamba": tiny_ssm("mamba"), "mamba2": tiny_ssm("mamba2")}


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


@pytest.mark.parametrize("family", FAMILIES)
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


@pytest.mark.parametrize("family", FAMILIES)
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


@pytest.mark.parametrize("family", FAMILIES)
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


@pytest.mark.parametrize("family", FAMILIES)
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


# -- a session's transcript (the JSON of GET /v1/sessions/{id}/transcript) --------------------
# (kind, prompt, max sampled tokens, sampling, seed): what a session's requests did
TURNS = [
    ("create", "ROMEO: ", 0, None, None),
    ("generate", "wherefore", 14, SamplingParams(temperature=0.8, top_k=20), 1),
    ("score", " art thou", 0, None, None),
    ("generate", "", 9, SamplingParams(temperature=0.0), None),
    ("rollback", None, 0, None, None),  # no ids: a marker in the lineage
    ("generate", "?", 12, SamplingParams(temperature=1.3, top_p=0.9), 7),
    ("keep", "", 5, SamplingParams(temperature=1.0, top_k=8, top_p=0.6), 3),
]


@torch.no_grad()
def session_transcript(lm: model.LanguageModel, turns=TURNS) -> dict:
    """A transcript as the server records one: every turn's prompt teacher-forced, then
    its tokens sampled (`sample`) and consumed one at a time; behaviour log-probs kept as
    the transcript stores them (float32)."""
    state = lm.new_state(1)
    segments: list[dict] = []
    n = 0
    V = lm.config.vocab_size
    for version, (kind, prompt, steps, params, seed) in enumerate(turns):
        seg = {"session_id": "s", "version": version, "kind": kind, "start": n, "ids": [], "sampled": [],
               "logprobs": [], "sampling": None, "seed": seed}  # fmt: skip
        if prompt is not None:
            ids = ([lm.tokenizer.bos_id] if kind == "create" else []) + lm.tokenizer.encode(prompt)
            if ids:
                _, state = lm.consume(ids, state)
            seg.update(ids=ids, sampled=[False] * len(ids), logprobs=[None] * len(ids))
        if steps:
            seg["sampling"] = dataclasses.asdict(params)
            gen = make_generator(seed)
            # what the request has seen, kept up to date as an engine would
            context = Context.of(
                [seg["ids"]], [[]], V, eos_id=lm.tokenizer.eos_id, history=params.uses_history
            )
            for _ in range(steps):
                tok, lp = sample(lm.next_logits(state), [params], [gen], context)
                context.advance(tok)
                _, state = lm(tok[None], state)
                seg["ids"].append(int(tok[0]))
                seg["sampled"].append(True)
                seg["logprobs"].append(float(np.float32(lp[0])))
        n += len(seg["ids"])
        segments.append(seg)
    return {
        "session_id": "s",
        "version": len(turns) - 1,
        "n_tokens": n,
        "complete": True,
        "segments": segments,
    }


def n_sampled(transcript: dict) -> int:
    return sum(sum(s["sampled"]) for s in transcript["segments"])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_transcript_replays_to_ratio_one_under_each_segments_settings(family):
    lm = families()[family]
    transcript = session_transcript(lm)
    rollout = transcript_rollout(transcript)
    assert len(rollout.ids) == transcript["n_tokens"] > 2 * lm.segment_len
    result = replay_transcript(lm, rollout)
    assert len(result.ratios) == n_sampled(transcript) == 14 + 9 + 12 + 5
    assert all(abs(r - 1) <= 1e-5 for r in result.ratios), result.ratios
    # prompt tokens are consumed, not scored; each action knows its request's context
    first = rollout.actions[0]
    assert first.position == len(lm.tokenizer.encode("ROMEO: wherefore")) + 1
    assert rollout.request_prompt(first) == lm.tokenizer.encode("wherefore")
    assert rollout.request_output(rollout.actions[3]) == [a.id for a in rollout.actions[:3]]
    report = replay_report(lm, rollout, result, top=3)
    assert report["n_actions"] == 40 and report["max_abs_ratio_minus_1"] <= 1e-5
    assert report["mean_ratio"] == pytest.approx(1, abs=1e-5) and len(report["worst"]) == 3
    assert set(report["worst"][0]) == {
        "position",
        "id",
        "text",
        "version",
        "logprob",
        "behaviour_logprob",
        "ratio",
    }


# the controls whose distribution depends on what the request has seen, and the others
CONTROLS = [
    ("generate", " thee", 16, SamplingParams(temperature=0.9, repetition_penalty=1.3, min_p=0.05), 11),
    ("score", " and", 0, None, None),
    (
        "generate",
        "",
        14,
        SamplingParams(temperature=1.1, presence_penalty=0.8, frequency_penalty=0.6, top_k=30),
        12,
    ),
    (
        "generate",
        "!",
        12,
        SamplingParams(logit_bias=((101, 4.0), (32, -3.0)), min_tokens=6, stop_token_ids=(10, 33)),
        13,
    ),
    (
        "generate",
        " O",
        10,
        SamplingParams(temperature=0.0, repetition_penalty=1.8, frequency_penalty=0.5),
        None,
    ),
]


@pytest.mark.parametrize("family", FAMILIES)
def test_penalties_bias_and_min_tokens_replay_from_each_requests_own_prompt_and_output(family):
    lm = families()[family]
    transcript = session_transcript(lm, TURNS + CONTROLS)
    rollout = transcript_rollout(transcript)
    result = replay_transcript(lm, rollout)
    assert len(result.ratios) == n_sampled(transcript) == 40 + 16 + 14 + 12 + 10
    assert all(abs(r - 1) <= 1e-5 for r in result.ratios), result.ratios
    # the controls do act: scored without them, their requests' actions move
    plain = copy.deepcopy(transcript)
    for seg in plain["segments"][len(TURNS) :]:
        if seg["sampling"]:
            seg["sampling"] = dataclasses.asdict(SamplingParams(temperature=seg["sampling"]["temperature"]))
    moved = replay_transcript(lm, transcript_rollout(plain)).ratios[40:]
    assert max(abs(r - 1) for r in moved) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_a_transcript_scored_under_other_settings_or_weights_moves_the_ratios(family):
    lm = families()[family]
    transcript = session_transcript(lm)
    # one segment's settings swapped for another's: its actions no longer replay to 1
    swapped = copy.deepcopy(transcript)
    swapped["segments"][1]["sampling"] = swapped["segments"][5]["sampling"]
    result = replay_transcript(lm, transcript_rollout(swapped))
    assert max(abs(r - 1) for r in result.ratios[:14]) > 1e-3
    assert max(abs(r - 1) for r in result.ratios[14:]) <= 1e-5
    updated = copy.deepcopy(lm)
    with torch.no_grad():
        next(updated.parameters()).add_(0.05)
    moved = replay_transcript(updated, transcript_rollout(transcript)).ratios
    assert max(abs(r - 1) for r in moved) > 1e-3


def test_since_version_scores_only_later_commits_but_rebuilds_from_the_start():
    lm = tiny_rlt()
    transcript = session_transcript(lm)
    rollout = transcript_rollout(transcript)
    later = replay_transcript(lm, rollout, since_version=3)
    assert [a.version for a in later.actions] == [5] * 12 + [6] * 5
    assert all(abs(r - 1) <= 1e-5 for r in later.ratios)
    # a parent's segments (a fork's inherited history) are never "since" a version of its own
    forked = copy.deepcopy(transcript)
    for seg in forked["segments"][:4]:
        seg["session_id"] = "parent"
    assert len(replay_transcript(lm, transcript_rollout(forked), since_version=0).actions) == 17


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda t: t.update(complete=False), "incomplete"),
        (lambda t: t.update(n_tokens=t["n_tokens"] + 1), "segments hold"),
        (lambda t: t["segments"][2].update(start=0), "starts at"),
        (lambda t: t["segments"][1]["sampling"].update(mirostat=5.0), "unknown to this version"),
        (lambda t: t["segments"][1].update(sampling=None), "needs its sampling parameters"),
        (lambda t: t["segments"][1]["logprobs"].__setitem__(-1, None), "no finite behaviour"),
        (lambda t: t["segments"][1]["sampled"].pop(), "same length"),
        (lambda t: t["segments"][0]["ids"].__setitem__(0, "a"), "token ids"),
        (lambda t: t.pop("segments"), "list of segments"),
    ],
)
def test_transcripts_replay_cannot_rebuild_are_refused(damage, message):
    transcript = session_transcript(tiny_txl())
    damage(transcript)
    with pytest.raises(ValueError, match=message):
        transcript_rollout(transcript)


def test_ids_outside_the_vocabulary_are_refused():
    lm = tiny_txl()
    transcript = session_transcript(lm)
    transcript["segments"][2]["ids"][0] = lm.config.vocab_size
    with pytest.raises(ValueError, match="vocabulary"):
        replay_transcript(lm, transcript_rollout(transcript))


@pytest.mark.parametrize("family", FAMILIES)
def test_recur_replay_reads_a_transcript_file(tmp_path, capsys, family):
    from app.cli import main

    lm = families()[family]
    model.save(lm, tmp_path / "m")
    transcript = session_transcript(lm)
    (tmp_path / "t.json").write_text(json.dumps(transcript))
    assert main(["replay", str(tmp_path / "m"), str(tmp_path / "t.json"), "--since-version", "4"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["n_actions"] == 17 and out["max_abs_ratio_minus_1"] <= 1e-5 and out["precision"] == "fp32"
    assert "replayed 17 sampled tokens" in captured.err
    with pytest.raises(SystemExit, match="recur replay: give a FILE, or --url and --session"):
        main(["replay", str(tmp_path / "m")])
    with pytest.raises(SystemExit, match="recur replay: --url and --session go together"):
        main(["replay", str(tmp_path / "m"), "--url", "http://127.0.0.1:1"])
