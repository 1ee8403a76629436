"""RL replay (RLT report, Sec. 5.3): recompute a rollout's action log-probs under the current weights.

A rollout is what a policy produced while it sampled: the prompt (every token the session
had consumed before generating, BOS included), the response tokens, an action mask (True
for tokens the policy sampled; False for tokens that were inserted, e.g. tool output, which
are consumed but not scored) and the behaviour log-probs mu recorded at sampling, i.e. the
`logprob` the generate endpoint returns with `logprobs: true`.

`replay` rebuilds the state from scratch (a new state, the prompt, then the response, each
teacher-forced through `LanguageModel.forward` in `segment_len` chunks) and scores every
action under the same sampling transform the sampler used (`sampling.behaviour_logprobs`:
temperature, top-k, top-p; greedy rows use the raw log-prob). The importance ratios are
exp(log p - log mu); with unchanged weights each is 1 within 1e-5, because both families give
the same logits however a stream is chunked.

Only the `LanguageModel` interface is used, so this works for every family. Nothing here
knows about HTTP or Redis.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .family import LanguageModel
from .sampling import SamplingParams, behaviour_logprobs


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


@torch.no_grad()
def replay(lm: LanguageModel, rollout: Rollout, params: SamplingParams | None = None) -> Replay:
    """Recompute every action's log-prob from scratch and return the importance ratios."""
    params = params or SamplingParams()
    was_training = lm.training
    lm.eval()
    try:
        state = lm.new_state(1)
        if rollout.prompt:
            _, state = lm.consume(rollout.prompt, state)
        resp = torch.tensor(rollout.response, dtype=torch.long, device=lm.device)[None]  # (1, R)
        R = resp.shape[1]
        # logits for response token i come from the state after prompt + response[:i]
        rows = [lm.next_logits(state)]  # (1, V)
        for start in range(0, max(R - 1, 0), lm.segment_len):
            logits, state = lm(resp[:, start : min(start + lm.segment_len, R - 1)], state)
            rows.extend(logits[0].unbind(0))
        logp: list[float] = []
        if R:
            logits_all = torch.stack([r.reshape(-1) for r in rows[:R]])  # (R, V)
            logp = behaviour_logprobs(logits_all, [params] * R, resp[0]).tolist()
    finally:
        lm.train(was_training)
    out_lp: list[float | None] = []
    ratios: list[float | None] = []
    for lp, act, mu in zip(logp, rollout.action_mask, rollout.behaviour_logprobs, strict=True):
        out_lp.append(lp if act else None)
        ratios.append(math.exp(lp - mu) if act and mu is not None else None)
    return Replay(out_lp, ratios)


# -- `recur replay` -------------------------------------------------------------------------
def _ids(lm: LanguageModel, value: object, what: str) -> list[int]:
    if isinstance(value, str):
        assert lm.tokenizer is not None
        return lm.tokenizer.encode(value)
    if isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return value
    raise ValueError(f"rollout {what} must be a string or a list of token ids")


def rollout_from_json(lm: LanguageModel, obj: dict) -> tuple[Rollout, SamplingParams]:
    """{"prompt": str|[int], "response": [int], "behaviour_logprobs": [float|null],
    "action_mask"?: [bool], "temperature"?, "top_k"?, "top_p"?} -> (Rollout, SamplingParams)."""
    if not isinstance(obj, dict):
        raise ValueError("a rollout must be a JSON object")
    rollout = Rollout(
        prompt=_ids(lm, obj.get("prompt", []), "prompt"),
        response=_ids(lm, obj.get("response", []), "response"),
        behaviour_logprobs=list(obj.get("behaviour_logprobs", [])),
        action_mask=[bool(a) for a in obj.get("action_mask", [])],
    )
    params = SamplingParams(
        temperature=float(obj.get("temperature", 1.0)),
        top_k=int(obj.get("top_k", 0)),
        top_p=float(obj.get("top_p", 1.0)),
    )
    return rollout, params


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "replay",
        help="recompute a rollout's action log-probs under a model and print the importance ratios",
        description="ROLLOUT is a JSON object (or a list of them) with prompt, response, "
        "behaviour_logprobs, optional action_mask and the sampling settings used.",
    )
    p.add_argument("model", help="shipped model name or checkpoint directory")
    p.add_argument("rollout", help="rollout JSON file ('-' for stdin)")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    import sys

    from . import checkpoint

    try:
        lm = checkpoint.load(args.model, device=args.device, precision="fp32")
        text = sys.stdin.read() if args.rollout == "-" else Path(args.rollout).read_text()
        data = json.loads(text)
        items = data if isinstance(data, list) else [data]
        results = [replay(lm, *rollout_from_json(lm, obj)).to_dict() for obj in items]
    except (FileNotFoundError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
        raise SystemExit(f"recur replay: {exc}") from None
    print(json.dumps(results if isinstance(data, list) else results[0]))
    return 0
