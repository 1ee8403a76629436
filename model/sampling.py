"""Token sampling with per-row controls, batched: the one definition of the distribution
a token is drawn from, shared by the sampler and by RL replay.

Every row of a batch carries its own `SamplingParams` and random generator, so requests
with different settings share one forward pass. `transform` is the distribution `draw`
(and `sample`) samples from; `behaviour_logprobs` scores given tokens under it: the
behaviour log-prob that RL replay needs. Both run these steps, in this order:

1. **repetition_penalty** r (HF's and vLLM's definition, from the CTRL paper): the logit
   of every token that occurs in the request's prompt or in its output so far is divided
   by r when positive and multiplied by r otherwise (r > 1 discourages repeats).
2. **frequency_penalty** f and **presence_penalty** p (OpenAI's definition): every
   logit loses f * c + p * [c > 0], c = how often the token occurs in the request's
   output so far (the prompt does not count).
3. **logit_bias**: each listed token's bias is added to its logit.
4. **min_tokens**: while the request has sampled fewer than `min_tokens` tokens, its
   `stop_token_ids` and EOS (unless `ignore_eos`) get -inf: they cannot be drawn.
   Steps 1-4 give the *adjusted logits*.
5. **temperature** t divides the adjusted logits; t < 1e-5 (0, say) is greedy: the argmax
   of the adjusted logits (vLLM's threshold: dividing by less would overflow float32).
   A t above float32's largest number (3.4e38) divides as that number: float32 would
   round it to inf, and a held-back token's -inf / inf is NaN, which poisons the whole
   row. Any t that large already makes every finite logit 0 (a uniform distribution over
   the tokens steps 1-4 left), so the bound changes no distribution.
6. **min_p**: tokens less probable than min_p times the most probable one are dropped.
7. **top_k** keeps the k most probable tokens, then **top_p** keeps the smallest set of
   the most probable ones whose mass (renormalised after 6 and 7's top_k) reaches top_p.
   Steps 6 and 7 always keep the most probable token.

"The request's prompt" is the tokens the request itself sent, not the context a session
consumed before it; "its output" is what it has sampled so far. A batch passes what each
row's request has seen as a `Context` (`Context.of` builds one from token lists, as
replay does from a transcript; the engine keeps one up to date with `Context.advance`).

The reported log-prob of a sampled row is log p(token) under the distribution after
step 7, the one it was drawn from. A greedy row (temperature 0) draws from a point mass;
it reports log_softmax(adjusted logits)[token] instead: with no penalty, bias or
min_tokens in force that is the model's unmodified log-prob, as before these controls.

Only steps a batch's rows actually use are computed, so a batch without the controls
pays nothing for them, and nothing here reads a tensor back to the host.

This module knows nothing of requests, HTTP or Redis.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

MAX_LOGIT_BIAS = 100.0  # OpenAI's range, -100..100
GREEDY_BELOW = 1e-5  # a temperature under this is greedy (vLLM's _SAMPLING_EPS)
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # beyond, a divided logit can overflow float32
# temperatures divide as at most this (step 5): float32 would round a larger one to inf
MAX_TEMPERATURE = float(torch.finfo(torch.float32).max)


def _pairs(value: Any) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from a mapping or an iterable of pairs
    (JSON turns the pairs into lists, and a mapping's keys into strings)."""
    items: Iterable[Any] = value.items() if isinstance(value, Mapping) else value
    out: dict[int, float] = {}
    for item in items:
        tid, bias = item
        if isinstance(tid, bool) or not isinstance(tid, (int, str)) or not str(tid).isdigit():
            raise ValueError(f"logit_bias: {tid!r} is not a token id")
        if int(tid) in out:
            raise ValueError(f"logit_bias: token {int(tid)} is listed twice")
        out[int(tid)] = float(bias)
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class SamplingParams:
    """A request's sampling controls (see the module docstring for what each does).

    Every field is plain JSON: `dataclasses.asdict` of it is what a session's transcript
    records, and `SamplingParams(**json.loads(json.dumps(asdict(p)))) == p`. `logit_bias`
    is stored as sorted (token id, bias) pairs (JSON: a list of [id, bias] lists); it
    may be given as a mapping {id: bias} (string ids too, as JSON objects have them).
    """

    temperature: float = 1.0  # 0 (below GREEDY_BELOW) = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        # normalise what JSON made of tuples, so a recorded transcript compares equal
        object.__setattr__(self, "logit_bias", _pairs(self.logit_bias))
        object.__setattr__(self, "stop_token_ids", tuple(sorted({int(i) for i in self.stop_token_ids})))
        for name, ok, rule in (
            ("temperature", 0 <= self.temperature < math.inf, "a finite number >= 0"),
            ("top_k", self.top_k >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            (
                "repetition_penalty",
                REPETITION_PENALTY_RANGE[0] <= self.repetition_penalty <= REPETITION_PENALTY_RANGE[1],
                "in [{:g}, {:g}]".format(*REPETITION_PENALTY_RANGE),
            ),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("min_tokens", self.min_tokens >= 0, ">= 0"),
            ("stop_token_ids", all(i >= 0 for i in self.stop_token_ids), "token ids (>= 0)"),
            (
                "logit_bias",
                all(-MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in self.logit_bias),
                f"biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            ),
        ):
            if not ok:  # NaN fails every comparison, so it lands here too
                raise ValueError(f"{name} must be {rule}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def uses_history(self) -> bool:
        """Whether its distribution depends on the tokens its request has seen (penalties)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def uses_context(self) -> bool:
        """Whether sampling it needs a `Context` (penalties, or min_tokens to count to)."""
        return self.uses_history or self.min_tokens > 0


@dataclass
class Context:
    """What each row's sampler knows of its request besides the logits: the tokens it has
    sampled (`generated`, for min_tokens) and, when penalties are in use, which tokens its
    prompt and output hold (`seen`) and how often its output holds each (`counts`)."""

    generated: list[int]  # per row: tokens the request has sampled so far
    seen: torch.Tensor | None = None  # (B, V) bool: in the request's prompt or output
    counts: torch.Tensor | None = None  # (B, V) float32: occurrences in the request's output
    eos_id: int | None = None  # the model's EOS, which min_tokens holds back
    _rows: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def of(
        cls,
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
        vocab_size: int,
        *,
        eos_id: int | None = None,
        device: torch.device | str | None = None,
        history: bool = True,
    ) -> Context:
        """The context of rows whose requests sent `prompts[i]` and have sampled
        `outputs[i]` so far. `history=False` leaves out `seen` and `counts` (enough when
        no row uses a penalty)."""
        if len(prompts) != len(outputs):
            raise ValueError("a context needs one prompt and one output per row")
        ctx = cls([len(o) for o in outputs], eos_id=eos_id)
        if history:
            B = len(outputs)
            counts = torch.zeros(B, vocab_size, device=device)
            seen = torch.zeros(B, vocab_size, dtype=torch.bool, device=device)
            out_r, out_c = _flat(outputs, vocab_size)
            pr_r, pr_c = _flat(prompts, vocab_size)
            ones = torch.ones(len(out_c), device=device)
            counts.index_put_((out_r.to(counts.device), out_c.to(counts.device)), ones, accumulate=True)
            seen[pr_r.to(seen.device), pr_c.to(seen.device)] = True
            ctx.counts, ctx.seen = counts, seen | (counts > 0)
        return ctx

    def advance(self, ids: torch.Tensor) -> None:
        """Every row has sampled ids[i] [B] (in place, without reading ids back)."""
        self.generated = [n + 1 for n in self.generated]
        if self.counts is not None and self.seen is not None:
            if self._rows is None or len(self._rows) != len(ids):
                self._rows = torch.arange(len(ids), device=ids.device)
            self.counts.index_put_(
                (self._rows, ids), torch.ones_like(ids, dtype=self.counts.dtype), accumulate=True
            )
            self.seen[self._rows, ids] = True


def _flat(lists: Sequence[Sequence[int]], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [i for i, ids in enumerate(lists) for _ in ids]
    cols = [t for ids in lists for t in ids]
    if any(not 0 <= t < vocab_size for t in cols):
        raise ValueError(f"a context token id is outside the vocabulary [0, {vocab_size})")
    return torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)


def make_generator(seed: int | None) -> torch.Generator:
    """A row's random generator, seeded (or from OS entropy for None). It lives on the CPU
    whatever the model's device: `draw` takes one uniform per row from it."""
    g = torch.Generator(device="cpu")
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


# -- the transform -----------------------------------------------------------------------------
def adjusted_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], context: Context | None
) -> torch.Tensor:
    """Steps 1-4 (penalties, logit_bias, min_tokens) on logits [B, V], in float32. A step
    no row uses is skipped: without any, the logits come back as they are."""
    x = logits.float()
    B, V = x.shape
    dev = x.device
    if any(p.uses_context for p in params) and (context is None or len(context.generated) != B):
        raise ValueError("penalties and min_tokens need each row's Context")
    if any(p.uses_history for p in params):
        assert context is not None
        if context.seen is None or context.counts is None:
            raise ValueError("penalties need the Context's history (Context.of(..., history=True))")
        r = _on(dev, [p.repetition_penalty for p in params])[:, None]
        x = torch.where(context.seen, torch.where(x > 0, x / r, x * r), x)  # step 1
        freq = _on(dev, [p.frequency_penalty for p in params])[:, None]
        pres = _on(dev, [p.presence_penalty for p in params])[:, None]
        x = x - freq * context.counts - pres * (context.counts > 0).float()  # step 2
    bias = [(i, t, b) for i, p in enumerate(params) for t, b in p.logit_bias]
    if bias:  # step 3
        _check_ids("logit_bias", [t for _, t, _ in bias], V)
        rows, cols, vals = zip(*bias, strict=True)
        x = x.index_put(_index(rows, cols, dev), _on(dev, list(vals)), accumulate=True)
    banned = _banned(params, context) if any(p.min_tokens for p in params) else []
    if banned:  # step 4
        _check_ids("stop_token_ids", [t for _, t in banned], V)
        rows, cols = zip(*banned, strict=True)
        x = x.index_put(_index(rows, cols, dev), x.new_full((), float("-inf")))
    return x


def _banned(params: Sequence[SamplingParams], context: Context | None) -> list[tuple[int, int]]:
    """(row, token) pairs min_tokens holds back now."""
    assert context is not None
    out = []
    for i, (p, n) in enumerate(zip(params, context.generated, strict=True)):
        if n < p.min_tokens:
            eos = () if p.ignore_eos or context.eos_id is None else (context.eos_id,)
            out += [(i, t) for t in {*p.stop_token_ids, *eos}]
    return out


def _index(rows: Sequence[int], cols: Sequence[int], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return _on(dev, list(rows), torch.long), _on(dev, list(cols), torch.long)


def _on(
    dev: torch.device, values: Sequence[float] | torch.Tensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Per-row values (built on the host) on `dev`. A plain copy to a CUDA device waits for
    the work queued on it, a host sync per tensor; from pinned memory, without blocking,
    it is queued after that work instead, and a step keeps its one sync (the read-back)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype or torch.float32)
    if dev.type != "cuda":
        return t.to(dev)
    return t.pin_memory().to(dev, non_blocking=True)


def _check_ids(what: str, ids: Sequence[int], V: int) -> None:
    bad = next((t for t in ids if t >= V), None)
    if bad is not None:
        raise ValueError(f"{what}: token id {bad} is outside the vocabulary [0, {V})")


def transform(
    logits: torch.Tensor, params: Sequence[SamplingParams], context: Context | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distribution `draw` samples from, steps 1-7: logits [B, V] -> (log-probs over
    the tokens sorted by descending adjusted logit [B, V], -inf where a step dropped them;
    that sort order [B, V]; the adjusted logits [B, V], sorted the same way).

    The one definition shared by sampling and RL replay. A greedy row's distribution here
    is the one it would have at temperature 1 (it reports the adjusted logits' log-softmax
    instead: see the module docstring)."""
    return _transform(adjusted_logits(logits, params, context), params)


def _transform(
    adjusted: torch.Tensor, params: Sequence[SamplingParams]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`transform`'s steps 5-7, from the adjusted logits [B, V]."""
    B, V = adjusted.shape
    dev = adjusted.device
    # (stable: among equal logits the lowest id first, the one argmax gives a greedy `draw`)
    sorted_adjusted, order = adjusted.sort(dim=-1, descending=True, stable=True)  # (B, V)
    sorted_logits = sorted_adjusted
    if any(p.temperature != 1 and not p.greedy for p in params):  # step 5 (greedy rows: as at 1)
        temp = _on(dev, [1.0 if p.greedy else min(p.temperature, MAX_TEMPERATURE) for p in params])
        sorted_logits = sorted_adjusted / temp[:, None]
    drop = None  # (B, V) bool, once a step drops anything
    if any(p.min_p > 0 for p in params):  # step 6: p < min_p * p_max <=> logit < max + log(min_p)
        log_min_p = _on(dev, [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params])
        drop = sorted_logits < (sorted_logits[:, :1] + log_min_p[:, None])
    if any(p.top_k for p in params):  # step 7
        rank = torch.arange(V, device=dev)[None]
        # (a k past the vocabulary keeps it all, and may not fit in int64)
        top_k = rank >= _on(dev, [min(p.top_k, V) or V for p in params], torch.long)[:, None]
        drop = top_k if drop is None else drop | top_k
    if any(p.top_p < 1 for p in params):
        kept = sorted_logits if drop is None else sorted_logits.masked_fill(drop, float("-inf"))
        probs = F.softmax(kept, -1)
        top_p = _on(dev, [p.top_p for p in params])
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        mass = (probs.cumsum(-1) - probs) >= top_p[:, None]
        mass[:, 0] = False  # (a top_p that float32 rounds to 0 would drop it too)
        drop = mass if drop is None else drop | mass
    if drop is None:
        return F.log_softmax(sorted_logits, -1), order, sorted_adjusted
    return F.log_softmax(sorted_logits.masked_fill(drop, float("-inf")), -1), order, sorted_adjusted


def behaviour_logprobs(
    logits: torch.Tensor, params: Sequence[SamplingParams], ids: torch.Tensor, context: Context | None = None
) -> torch.Tensor:
    """Log-probs [B] of the given token ids [B] exactly as `draw` reports them: under the
    transformed distribution (-inf for a token it could not have drawn), or, for greedy
    rows, under the adjusted logits' log-softmax. `context` says what each row's request
    had seen (`Context.of(prompts, outputs, vocab_size, eos_id=...)`); it is needed only
    when a row uses a penalty or min_tokens."""
    adjusted = adjusted_logits(logits, params, context)
    logp_sorted, order, _ = _transform(adjusted, params)
    logp = torch.empty_like(logp_sorted).scatter_(1, order, logp_sorted)  # back to vocabulary order
    if any(p.greedy for p in params):
        greedy = _on(logp.device, [p.greedy for p in params], torch.bool)[:, None]
        logp = torch.where(greedy, _greedy_logprobs(adjusted), logp)
    return logp.gather(1, ids[:, None])[:, 0]


def _uniforms(generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One uniform [B] from each row's own generator."""
    return torch.stack([torch.rand((), generator=g) for g in generators])


def _greedy_logprobs(adjusted: torch.Tensor) -> torch.Tensor:
    """A greedy row's reported log-probs [B, V], in vocabulary order: the adjusted logits'
    log-softmax (see the module docstring). Taken in vocabulary order by every path (a sum
    in another order rounds differently), so a greedy token's log-prob is the same whether
    its batch's draw sorted the vocabulary or not."""
    return F.log_softmax(adjusted, -1)


@dataclass
class Draw:
    """What `draw` sampled: per row a token and its behaviour log-prob and, when asked,
    the `top` most probable tokens under the same distribution (-inf past the tokens it
    could draw)."""

    ids: torch.Tensor  # (B,)
    logprobs: torch.Tensor  # (B,)
    top_ids: torch.Tensor | None = None  # (B, top)
    top_logprobs: torch.Tensor | None = None  # (B, top)


def draw(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    context: Context | None = None,
    top: int = 0,
) -> Draw:
    """Sample one token per row from logits [B, V] (see `behaviour_logprobs` for the
    log-probs, and `Context` for `context`); `top` > 0 adds each row's `top` most
    probable alternatives."""
    B, V = logits.shape
    adjusted = adjusted_logits(logits, params, context)
    if not top and all(p.greedy for p in params):
        # every row greedy (a client's temperature 0): the argmax, and no sort of the
        # vocabulary per row per step, the same token and log-prob as the sorted draw below
        _uniforms(generators)  # (each row's generator moves on as in any draw)
        ids = adjusted.argmax(-1)
        return Draw(ids, _greedy_logprobs(adjusted).gather(1, ids[:, None])[:, 0])
    logp, order, _ = _transform(adjusted, params)
    dev = logp.device
    greedy = _on(dev, [p.greedy for p in params], torch.bool)
    # inverse-CDF draw with one uniform per row from that row's own generator, drawn once
    # the parameters have passed (a refused batch's rows retry alone from the same point)
    u = _on(dev, _uniforms(generators))
    cdf = logp.exp().cumsum(-1)
    # kept tokens form a prefix of the sorted order, so the draw can never land past it
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None])[:, 0].clamp(max=V - 1)
    pick = torch.where(greedy, torch.zeros_like(pick), pick)
    if any(p.greedy for p in params):
        logp = torch.where(greedy[:, None], _greedy_logprobs(adjusted).gather(1, order), logp)
    out = Draw(order.gather(1, pick[:, None])[:, 0], logp.gather(1, pick[:, None])[:, 0])
    if top:
        k = min(top, V)
        out.top_ids, out.top_logprobs = order[:, :k], logp[:, :k]
    return out


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    context: Context | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (token ids [B], behaviour log-probs [B]): `draw` without alternatives."""
    d = draw(logits, params, generators, context)
    return d.ids, d.logprobs
