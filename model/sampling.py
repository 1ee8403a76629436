"""Token sampling with per-stream parameters, batched.

Every row of a batch carries its own temperature, top-k, top-p and random generator, so
sessions with different settings share one forward pass. The returned log-probability is
the one under the distribution actually sampled from (after temperature, top-k and
top-p): the behaviour log-prob that RL replay needs. Greedy rows (temperature 0) report
the model's unmodified log-probability of the argmax token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and self.temperature < float("inf")):
            raise ValueError("temperature must be a finite number >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not (0 < self.top_p <= 1):
            raise ValueError("top_p must be in (0, 1]")


def make_generator(seed: int | None) -> torch.Generator:
    """A row's random generator, seeded (or from OS entropy for None). It lives on the CPU
    whatever the model's device: `sample` draws one uniform per row from it."""
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def transform(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution `sample` draws from: logits [B, V] -> (log-probs over the tokens
    sorted by descending logit [B, V], -inf where top-k / top-p dropped them; that sort
    order [B, V]). The one definition shared by sampling and RL replay."""
    B, V = logits.shape
    logits = logits.float()
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], device=dev)
    greedy = temp == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temp), temp)[:, None]
    sorted_logits, order = scaled.sort(-1, descending=True)  # (B, V)
    rank = torch.arange(V, device=dev)[None]
    top_k = torch.tensor([p.top_k or V for p in params], device=dev)
    drop = rank >= top_k[:, None]
    probs = F.softmax(sorted_logits.masked_fill(drop, float("-inf")), -1)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    drop = drop | ((probs.cumsum(-1) - probs) >= top_p[:, None])
    return F.log_softmax(sorted_logits.masked_fill(drop, float("-inf")), -1), order


def behaviour_logprobs(logits: torch.Tensor, params: list[SamplingParams], ids: torch.Tensor) -> torch.Tensor:
    """Log-probs [B] of the given token ids [B] exactly as `sample` reports them: under the
    transformed distribution (-inf for a token it could not have drawn), or the model's
    unmodified log-prob for greedy rows."""
    logits = logits.float()
    logp_sorted, order = transform(logits, params)
    logp = torch.empty_like(logp_sorted).scatter_(1, order, logp_sorted)  # back to vocabulary order
    chosen = logp.gather(1, ids[:, None])[:, 0]
    raw = F.log_softmax(logits, -1).gather(1, ids[:, None])[:, 0]
    greedy = torch.tensor([p.temperature == 0 for p in params], device=logits.device)
    return torch.where(greedy, raw, chosen)


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (token ids [B], behaviour log-probs [B])."""
    B, V = logits.shape
    logits = logits.float()
    dev = logits.device
    greedy = torch.tensor([p.temperature == 0 for p in params], device=dev)
    logp, order = transform(logits, params)
    # inverse-CDF draw with one uniform per row from that row's own generator
    u = torch.stack([torch.rand((), generator=g) for g in generators]).to(dev)
    cdf = logp.exp().cumsum(-1)
    # kept tokens form a prefix of the sorted order, so the draw can never land past it
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None])[:, 0].clamp(max=V - 1)
    pick = torch.where(greedy, torch.zeros_like(pick), pick)
    ids = order.gather(1, pick[:, None])[:, 0]
    chosen = logp.gather(1, pick[:, None])[:, 0]
    raw = F.log_softmax(logits, -1).gather(1, ids[:, None])[:, 0]
    return ids, torch.where(greedy, raw, chosen)
