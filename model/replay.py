"""RL replay (RLT report, Sec. 5.3): recompute a rollout's action log-probs under the current weights.

Two inputs describe what a policy produced while it sampled:

- a **rollout**: the prompt (every token the session had consumed before generating, BOS
  included), the response tokens, an action mask (True for tokens the policy sampled;
  False for tokens that were inserted, e.g. tool output, which are consumed but not
  scored) and the behaviour log-probs mu recorded at sampling, i.e. the `logprob` the
  generate endpoint returns with `logprobs: true`; one set of sampling settings for all;
- a session's **transcript** (the JSON of `GET /v1/sessions/{id}/transcript`): the
  segments its state consumed, in order, each with its ids, action mask, behaviour
  log-probs and the sampling parameters of the request that made it
  (`transcript_rollout`). Every segment's sampled tokens are actions, each scored under
  its own segment's parameters; prompt tokens are consumed, never scored.

Replay rebuilds the state from scratch (a new state, then every token teacher-forced
through `LanguageModel.forward` in `segment_len` chunks) and scores every action under the
same sampling transform the sampler used (`sampling.behaviour_logprobs`). The importance
ratios are exp(log p - log mu); with unchanged weights each is 1 within 1e-5 in fp32,
because both families give the same logits however a stream is chunked.

Only the `LanguageModel` interface is used, so this works for every family. Nothing here
knows about HTTP or Redis: `app/replay_client.py` fetches transcripts and runs the command.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .family import LanguageModel
from .sampling import Context, SamplingParams, behaviour_logprobs


@dataclass
class Rollout:
    prompt: list[int]
    response: list[int]
    behaviour_logprobs: list[float | None]  # per response token; None where not an action
    action_mask: list[bool] = field(default_factory=list)  # empty = every response token is an action

    def __post_init__(self) -> None:
        if not self.action_mask:
            self.action_mask = [True] * len(self.response)
        if not (len(self.response) == len(self.action_mask) == len(self.behaviour_logprobs)):
            raise ValueError("response, action_mask and behaviour_logprobs must have the same length")
        for i, (act, mu) in enumerate(zip(self.action_mask, self.behaviour_logprobs, strict=True)):
            if act and (mu is None or not math.isfinite(mu)):
                raise ValueError(f"action {i} has no finite behaviour log-prob")


@dataclass
class Replay:
    logprobs: list[float | None]  # log p under the current weights, None for non-actions
    ratios: list[float | None]  # exp(log p - log mu), None for non-actions

    def to_dict(self) -> dict:
        acts = [r for r in self.ratios if r is not None]
        worst = max((abs(math.log(r)) if r > 0 else math.inf for r in acts), default=0.0)
        return {"logprobs": self.logprobs, "ratios": self.ratios, "max_abs_log_ratio": worst}


def teacher_forced(
    lm: LanguageModel, ids: list[int], positions: list[int]
) -> Iterator[tuple[list[int], torch.Tensor]]:
    """Teacher-force `ids` from a new state, `segment_len` tokens at a time, and yield, per
    forward chunk, (the `positions` it reached, the logits [k, V] predicting the token at
    each: from the state after ids[:position]). `positions` ascend, without repeats; the
    tokens after the last one are not consumed. Rows come a chunk at a time, so a large
    vocabulary never holds every action's logits at once."""
    was_training = lm.training
    lm.eval()
    try:
        with torch.no_grad():
            state = lm.new_state(1)
            j = 0
            if positions and positions[0] == 0:
                yield [0], lm.next_logits(state).float()
                j = 1
            end = positions[-1] if positions else 0
            seq = torch.tensor(ids[:end], dtype=torch.long, device=lm.device)[None]  # (1, end)
            for start in range(0, end, lm.segment_len):
                logits, state = lm(seq[:, start : start + lm.segment_len], state)  # (1, T, V)
                k = j
                while k < len(positions) and positions[k] <= start + logits.shape[1]:
                    k += 1
                if k > j:  # logits[:, i] predict token start + i + 1
                    yield positions[j:k], logits[0, [p - 1 - start for p in positions[j:k]]].float()
                j = k
    finally:
        lm.train(was_training)


def replay(lm: LanguageModel, rollout: Rollout, params: SamplingParams | None = None) -> Replay:
    """Recompute every action's log-prob from scratch and return the importance ratios."""
    params = params or SamplingParams()
    ids = [*rollout.prompt, *rollout.response]
    offset = len(rollout.prompt)
    R = len(rollout.response)
    logp: list[float] = []
    for at, rows in teacher_forced(lm, ids, list(range(offset, offset + R))):
        chosen = torch.tensor([ids[p] for p in at], dtype=torch.long, device=rows.device)
        with torch.no_grad():
            logp += behaviour_logprobs(rows, [params] * len(at), chosen).tolist()
    out_lp: list[float | None] = []
    ratios: list[float | None] = []
    for lp, act, mu in zip(logp, rollout.action_mask, rollout.behaviour_logprobs, strict=True):
        out_lp.append(lp if act else None)
        ratios.append(math.exp(lp - mu) if act and mu is not None else None)
    return Replay(out_lp, ratios)


# -- the JSON documents `recur replay` reads -----------------------------------------------
def _ids(lm: LanguageModel, value: object, what: str) -> list[int]:
    if isinstance(value, str):
        assert lm.tokenizer is not None
        return lm.tokenizer.encode(value)
    if isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return value
    raise ValueError(f"rollout {what} must be a string or a list of token ids")


ROLLOUT_FIELDS = ("prompt", "response", "behaviour_logprobs", "action_mask")


def rollout_from_json(lm: LanguageModel, obj: dict) -> tuple[Rollout, SamplingParams]:
    """{"prompt": str|[int], "response": [int], "behaviour_logprobs": [float|null],
    "action_mask"?: [bool], and the sampling settings used ("temperature"?, "top_k"?,
    "top_p"?, "min_p"?, "logit_bias"?, ...)} -> (Rollout, SamplingParams). A rollout does
    not say which tokens were its request's own prompt, so the settings that depend on
    them (penalties, min_tokens) need a transcript instead."""
    if not isinstance(obj, dict):
        raise ValueError("a rollout must be a JSON object")
    rollout = Rollout(
        prompt=_ids(lm, obj.get("prompt", []), "prompt"),
        response=_ids(lm, obj.get("response", []), "response"),
        behaviour_logprobs=list(obj.get("behaviour_logprobs", [])),
        action_mask=[bool(a) for a in obj.get("action_mask", [])],
    )
    params = sampling_params({k: v for k, v in obj.items() if k not in ROLLOUT_FIELDS})
    if params.uses_context:
        raise ValueError("penalties and min_tokens depend on the request's own prompt: replay its transcript")
    return rollout, params


def replay_document(lm: LanguageModel, data: Any, since_version: int | None = None, top: int = 10) -> Any:
    """Replay a parsed JSON document: a transcript (an object with `segments`) gives its
    `report`; a rollout gives `Replay.to_dict()`, a list of rollouts a list of them."""
    if isinstance(data, dict) and "segments" in data:
        rollout = transcript_rollout(data)
        return report(lm, rollout, replay_transcript(lm, rollout, since_version), top)
    if since_version is not None:
        raise ValueError("since_version applies to a transcript, not to a rollout")
    items = data if isinstance(data, list) else [data]
    results = [replay(lm, *rollout_from_json(lm, obj)).to_dict() for obj in items]
    return results if isinstance(data, list) else results[0]


# -- a session's transcript -------------------------------------------------------------------
@dataclass(frozen=True)
class Action:
    """One sampled token of a transcript, with what its request's sampler knew."""

    position: int  # in the session's token stream (0 = its first token)
    id: int
    behaviour_logprob: float
    params: SamplingParams  # its segment's sampling parameters
    session_id: str  # the session whose commit holds it (a fork's parent, for inherited ones)
    version: int  # the version that commit made
    segment_start: int  # where its segment (its request) begins in the stream


@dataclass
class TranscriptRollout:
    session_id: str
    ids: list[int]  # every token the session's state consumed, in order
    sampled: list[bool]  # the action mask over `ids`
    actions: list[Action]

    def request_prompt(self, a: Action) -> list[int]:
        """The prompt of the request that sampled `a`: its segment's unsampled tokens
        (they all come before the first sampled one)."""
        span = range(a.segment_start, a.position)
        return [self.ids[i] for i in span if not self.sampled[i]]

    def request_output(self, a: Action) -> list[int]:
        """The tokens the request that sampled `a` had sampled before it."""
        span = range(a.segment_start, a.position)
        return [self.ids[i] for i in span if self.sampled[i]]


def sampling_params(obj: Any) -> SamplingParams:
    """A segment's `sampling` field (`dataclasses.asdict(SamplingParams)`) -> SamplingParams.
    A field this `SamplingParams` lacks is refused: replay would score under another
    distribution than the one sampled from."""
    if not isinstance(obj, dict):
        raise ValueError("a segment with sampled tokens needs its sampling parameters (an object)")
    unknown = sorted(set(obj) - {f.name for f in dataclasses.fields(SamplingParams)})
    if unknown:
        raise ValueError(f"sampling field(s) {', '.join(unknown)} are unknown to this version of replay")
    try:  # SamplingParams turns what JSON made of its tuples back into tuples
        return SamplingParams(**obj)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad sampling parameters: {exc}") from None


def transcript_rollout(transcript: Any) -> TranscriptRollout:
    """Check a transcript (the JSON of the transcript route) and turn it into what replay
    scores. Raises ValueError with a clear message for one replay cannot rebuild: an
    incomplete history (trimmed or imported), or segments that do not add up."""
    if not isinstance(transcript, dict) or not isinstance(transcript.get("segments"), list):
        raise ValueError("a transcript must be a JSON object with a list of segments")
    if transcript.get("complete") is not True:
        raise ValueError(
            "the transcript is incomplete (older segments were dropped, or the session was imported): "
            "replay needs every token from the session's start"
        )
    out = TranscriptRollout(str(transcript.get("session_id", "")), [], [], [])
    for seg in transcript["segments"]:
        _add_segment(out, seg)
    n = transcript.get("n_tokens")
    if n is not None and n != len(out.ids):
        raise ValueError(f"the segments hold {len(out.ids)} tokens, the session {n}")
    return out


def _add_segment(out: TranscriptRollout, seg: Any) -> None:
    if not isinstance(seg, dict):
        raise ValueError("a transcript segment must be an object")
    ids, sampled, mus = seg.get("ids") or [], seg.get("sampled") or [], seg.get("logprobs") or []
    if not (isinstance(ids, list) and isinstance(sampled, list) and isinstance(mus, list)):
        raise ValueError(f"segment {seg.get('version')}: ids, sampled and logprobs must be lists")
    version = seg.get("version")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"segment {version}: ids must be a list of token ids")
    if not (len(ids) == len(sampled) == len(mus)):
        raise ValueError(f"segment {version}: ids, sampled and logprobs must have the same length")
    if ids and seg.get("start", len(out.ids)) != len(out.ids):
        raise ValueError(f"segment {version} starts at {seg.get('start')}, after {len(out.ids)} tokens")
    start = len(out.ids)
    params = sampling_params(seg.get("sampling")) if any(sampled) else None
    for i, (tok, act, mu) in enumerate(zip(ids, sampled, mus, strict=True)):
        if act:
            if not isinstance(mu, (int, float)) or not math.isfinite(mu):
                raise ValueError(f"segment {version}: sampled token {i} has no finite behaviour log-prob")
            assert params is not None
            sid = str(seg.get("session_id", out.session_id))
            out.actions.append(Action(start + i, tok, float(mu), params, sid, int(version or 0), start))
        out.ids.append(tok)
        out.sampled.append(bool(act))


@dataclass
class TranscriptReplay:
    actions: list[Action]  # the actions scored, in stream order
    logprobs: list[float]  # log p under the current weights (-inf: the sampler could not draw it now)
    ratios: list[float]  # exp(log p - log mu)


def replay_transcript(
    lm: LanguageModel, rollout: TranscriptRollout, since_version: int | None = None
) -> TranscriptReplay:
    """Rebuild the session's states from its first token under `lm` and score its actions:
    all of them, or (since_version) only those the session itself committed after that
    version, as the transcript route's `since_version` selects; the states are rebuilt
    from the start either way."""
    vocab = int(getattr(lm.config, "vocab_size", 0)) or None
    if vocab is not None and any(t >= vocab for t in rollout.ids):
        raise ValueError(f"the transcript holds token ids outside this model's vocabulary ({vocab})")
    acts = [
        a
        for a in rollout.actions
        if since_version is None or (a.session_id == rollout.session_id and a.version > since_version)
    ]
    by_position = {a.position: a for a in acts}
    logp: list[float] = []
    for at, rows in teacher_forced(lm, rollout.ids, [a.position for a in acts]):
        logp += _score(lm, rollout, [by_position[p] for p in at], rows)
    ratios = [math.exp(min(lp - a.behaviour_logprob, 700.0)) for lp, a in zip(logp, acts, strict=True)]
    return TranscriptReplay(acts, logp, ratios)


def _score(
    lm: LanguageModel, rollout: TranscriptRollout, acts: list[Action], rows: torch.Tensor
) -> list[float]:
    """Behaviour log-probs of `acts` from their logits rows, each under its own request's
    sampling parameters and what that request had seen (its prompt and its output so
    far: penalties and min_tokens depend on them)."""
    params = [a.params for a in acts]
    context = None
    if any(p.uses_context for p in params):
        context = Context.of(
            [rollout.request_prompt(a) if a.params.uses_history else [] for a in acts],
            [rollout.request_output(a) if a.params.uses_context else [] for a in acts],
            rows.shape[1],
            eos_id=lm.tokenizer.eos_id if lm.tokenizer is not None else None,
            device=rows.device,
            history=any(p.uses_history for p in params),
        )
    chosen = torch.tensor([a.id for a in acts], dtype=torch.long, device=rows.device)
    with torch.no_grad():
        return behaviour_logprobs(rows, params, chosen, context).tolist()


def report(lm: LanguageModel, rollout: TranscriptRollout, result: TranscriptReplay, top: int = 10) -> dict:
    """The ratio statistics as JSON: the largest |ratio - 1|, the mean ratio, the `top`
    worst tokens, and every action's log-probs and ratio (in stream order)."""
    dev = [abs(r - 1) for r in result.ratios]
    worst = sorted(range(len(dev)), key=lambda i: -dev[i])[:top]
    token_text = lm.tokenizer.token_text if lm.tokenizer is not None else str
    return {
        "session_id": rollout.session_id,
        "n_tokens": len(rollout.ids),
        "n_actions": len(result.actions),
        "precision": lm.precision,
        "max_abs_ratio_minus_1": max(dev, default=0.0),
        "mean_ratio": sum(result.ratios) / len(dev) if dev else None,
        "worst": [_token(result, i, token_text) for i in worst],
        "positions": [a.position for a in result.actions],
        "logprobs": [_finite(lp) for lp in result.logprobs],
        "behaviour_logprobs": [a.behaviour_logprob for a in result.actions],
        "ratios": result.ratios,
    }


def _token(result: TranscriptReplay, i: int, token_text: Any) -> dict:
    a = result.actions[i]
    return {
        "position": a.position,
        "id": a.id,
        "text": token_text(a.id),
        "version": a.version,
        "logprob": _finite(result.logprobs[i]),
        "behaviour_logprob": a.behaviour_logprob,
        "ratio": result.ratios[i],
    }


def _finite(x: float) -> float | None:
    """JSON has no infinities: a token the current sampler could not draw shows as null."""
    return x if math.isfinite(x) else None
