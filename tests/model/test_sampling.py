"""Sampling: per-row controls, seeded determinism, and behaviour log-probs.

The controls are checked against a reference written out row by row from their
definitions (model/sampling.py's docstring), and the transform's distribution by a
property test: it sums to 1 and never gives a dropped or held-back token probability."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from model.sampling import (
    Context,
    SamplingParams,
    behaviour_logprobs,
    draw,
    make_generator,
    sample,
    transform,
)
from tests.conftest import examples


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


def test_min_p_drops_tokens_below_its_share_of_the_top_one():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = make_generator(1)
    # min_p 0.25: the threshold is 0.125, so 0.05 goes and the rest renormalise
    seen = set()
    for _ in range(400):
        ids, lp = sample(logits, [SamplingParams(1.0, min_p=0.25)], [g])
        seen.add(int(ids))
        assert math.isclose(float(lp), math.log([0.5, 0.3, 0.15][int(ids)] / 0.95), rel_tol=1e-5)
    assert seen == {0, 1, 2}


def test_extreme_values_stay_numbers():
    """A temperature below 1e-5 is greedy (dividing by it would overflow float32); a top_p
    that float32 rounds to 0 keeps the most probable token."""
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(8)) * 20
    for p in (SamplingParams(temperature=5e-324), SamplingParams(temperature=1e-6, top_p=5e-324)):
        ids, lp = sample(logits, [p] * 2, [make_generator(0)] * 2)
        assert torch.equal(ids, logits.argmax(-1)) and torch.isfinite(lp).all()
    ids, lp = sample(logits, [SamplingParams(top_p=5e-324, min_p=5e-324)] * 2, [make_generator(0)] * 2)
    assert torch.equal(ids, logits.argmax(-1)) and torch.equal(lp, torch.zeros(2))
    ctx = Context.of([[int(logits[0].argmax())]], [[]], 30)
    ids, lp = sample(
        logits[:1], [SamplingParams(repetition_penalty=0.01, temperature=1e-5)], [make_generator(0)], ctx
    )
    assert torch.isfinite(lp).all()


@given(st.integers(0, 2**31 - 1), st.integers(1, 5), st.booleans(), st.integers(0, 3))
@examples(3)
def test_an_all_greedy_batch_draws_as_the_sorted_path_does(seed, B, ties, top):
    """An all-greedy batch skips the sort of the vocabulary (`draw`'s argmax path); a batch
    with one sampled row more, or asked for alternatives, takes the sorted path. The greedy
    rows' tokens (the lowest id among equal maxima) and log-probs are the same either way,
    and the same as `behaviour_logprobs` reports for them."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, 64, generator=g)
    if ties:  # equal maxima: quantised logits tie often
        logits = (logits * 2).round()
    params = [SamplingParams(0.0, logit_bias={5: 1.0} if i % 2 else {}) for i in range(B)]
    fast = draw(logits, params, [make_generator(i) for i in range(B)], top=0)
    mixed = draw(
        torch.cat([logits, logits[:1]]), [*params, SamplingParams(0.9)], [make_generator(i) for i in range(B + 1)]
    )
    alts = draw(logits, params, [make_generator(i) for i in range(B)], top=top)
    adjusted = logits.clone()
    adjusted[1::2, 5] += 1.0
    first_max = torch.tensor([row.tolist().index(max(row.tolist())) for row in adjusted])
    assert torch.equal(fast.ids, first_max)
    for other in (mixed, alts):
        assert torch.equal(other.ids[:B], fast.ids)
        assert torch.equal(other.logprobs[:B], fast.logprobs)
    assert torch.equal(behaviour_logprobs(logits, params, fast.ids), fast.logprobs)
    if top:
        assert alts.top_ids is not None and alts.top_logprobs is not None
        assert torch.equal(alts.top_ids[:, 0], fast.ids) and torch.equal(alts.top_logprobs[:, 0], fast.logprobs)


def test_mixed_parameters_in_one_batch_match_running_alone():
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(4))
    params = [
        SamplingParams(0.0),
        SamplingParams(0.8, top_k=7, repetition_penalty=1.3),
        SamplingParams(1.0, top_p=0.5, logit_bias={3: 5.0}),
        SamplingParams(
            1.2, min_p=0.1, presence_penalty=0.5, frequency_penalty=0.3, min_tokens=4, stop_token_ids=(1,)
        ),
    ]
    prompts, outputs = [[1, 2], [3, 3, 4], [], [5]], [[], [7, 7], [1], [9, 9, 9]]
    ctx = Context.of(prompts, outputs, 40, eos_id=0)
    ids, lp = sample(logits, params, [make_generator(s) for s in (5, 6, 7, 8)], ctx)
    for i, (p, s) in enumerate(zip(params, (5, 6, 7, 8), strict=True)):
        one_ctx = Context.of([prompts[i]], [outputs[i]], 40, eos_id=0)
        one, one_lp = sample(logits[i : i + 1], [p], [make_generator(s)], one_ctx)
        assert int(one) == int(ids[i]) and math.isclose(float(one_lp), float(lp[i]), rel_tol=1e-6)


# -- the controls against their definitions, row by row -----------------------------------------
def reference_adjusted(
    logits: list[float], p: SamplingParams, prompt: list[int], output: list[int], eos: int | None
) -> list[float]:
    """Steps 1-4 for one row, written out from the definitions."""
    x = list(logits)
    for t in set(prompt) | set(output):  # repetition: over the prompt and the output
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):  # frequency and presence: over the output only
        c = output.count(t)
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    for t, b in p.logit_bias:
        x[t] += b
    if len(output) < p.min_tokens:
        for t in {*p.stop_token_ids, *([] if p.ignore_eos or eos is None else [eos])}:
            x[t] = -math.inf
    return x


def reference_logprob(logits: list[float], p: SamplingParams, prompt, output, eos, token: int) -> float:
    x = reference_adjusted(logits, p, prompt, output, eos)
    if p.temperature == 0:
        return float(torch.log_softmax(torch.tensor(x), -1)[token])
    z = [v / p.temperature for v in x]
    ranked = sorted(range(len(z)), key=lambda t: -z[t])
    top = z[ranked[0]]
    keep = [t for t in ranked if z[t] >= top + (math.log(p.min_p) if p.min_p else -math.inf)]
    if p.top_k:
        keep = keep[: p.top_k]
    probs = torch.softmax(torch.tensor([z[t] for t in keep]), -1).tolist()
    kept, mass = [], 0.0
    for t, q in zip(keep, probs, strict=True):
        if mass >= p.top_p:
            break
        kept.append(t)
        mass += q
    if token not in kept:
        return -math.inf
    return float(torch.log_softmax(torch.tensor([z[t] for t in kept]), -1)[kept.index(token)])


CASES = [
    SamplingParams(1.0, repetition_penalty=1.5),
    SamplingParams(0.7, repetition_penalty=0.8, top_k=5),
    SamplingParams(1.0, presence_penalty=1.5, frequency_penalty=-0.5),
    SamplingParams(1.3, frequency_penalty=2.0, top_p=0.8),
    SamplingParams(1.0, logit_bias={2: 100.0, 4: -100.0}, min_p=0.05),
    SamplingParams(0.9, min_tokens=5, stop_token_ids=(3, 6)),
    SamplingParams(1.0, min_tokens=5, ignore_eos=True),
    SamplingParams(0.0, repetition_penalty=1.2, presence_penalty=0.4, logit_bias={1: 3.0}, min_tokens=9),
    SamplingParams(0.5, repetition_penalty=2.0, presence_penalty=0.2, frequency_penalty=0.3, logit_bias={0: -2.0},
                   min_p=0.01, top_k=12, top_p=0.9, min_tokens=3, stop_token_ids=(5,)),
]  # fmt: skip


@pytest.mark.parametrize("params", CASES)
def test_behaviour_logprobs_match_the_definitions(params):
    V, eos = 16, 0
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(6, V, generator=gen) * 2
    prompts = [[1, 2, 2], [], [3], [4, 5, 6, 7], [8], [1]]
    outputs = [[2, 9, 9], [4], [], [3, 3, 3, 1], [10, 11], [12, 12, 0]]
    ctx = Context.of(prompts, outputs, V, eos_id=eos)
    for token in range(V):
        ids = torch.full((6,), token)
        got = behaviour_logprobs(logits, [params] * 6, ids, ctx).tolist()
        want = [
            reference_logprob(logits[i].tolist(), params, prompts[i], outputs[i], eos, token)
            for i in range(6)
        ]
        for g, w in zip(got, want, strict=True):
            assert (g == w == -math.inf) or math.isclose(g, w, rel_tol=1e-4, abs_tol=1e-5), (token, got, want)


@pytest.mark.parametrize("params", CASES)
def test_drawn_tokens_report_their_behaviour_logprobs(params):
    V = 16
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(3))
    ctx = Context.of([[1, 1], [2], [], [3, 4], [5]], [[6], [], [7, 7], [8], [1, 2, 3]], V, eos_id=0)
    d = draw(logits, [params] * 5, [make_generator(i) for i in range(5)], ctx, top=4)
    again = behaviour_logprobs(logits, [params] * 5, d.ids, ctx)
    assert torch.allclose(d.logprobs, again)
    assert torch.isfinite(d.logprobs).all()  # a drawn token always had probability
    assert d.top_logprobs is not None and d.top_ids is not None
    assert (d.top_logprobs[:, :-1] >= d.top_logprobs[:, 1:]).all()  # most probable first
    top_again = behaviour_logprobs(
        logits.repeat_interleave(4, 0), [params] * 20, d.top_ids.reshape(-1), _repeat(ctx, 4)
    ).reshape(5, 4)
    assert torch.allclose(d.top_logprobs, top_again)


def _repeat(ctx: Context, n: int) -> Context:
    assert ctx.seen is not None and ctx.counts is not None
    gen = [g for g in ctx.generated for _ in range(n)]
    return Context(gen, ctx.seen.repeat_interleave(n, 0), ctx.counts.repeat_interleave(n, 0), ctx.eos_id)


def test_greedy_takes_the_argmax_of_the_adjusted_logits():
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]])
    p = SamplingParams(0.0, repetition_penalty=2.0)
    ctx = Context.of([[0]], [[]], 4)  # the prompt holds token 0: 3.0 -> 1.5
    ids, lp = sample(logits, [p], [make_generator(0)], ctx)
    adjusted = torch.tensor([1.5, 2.9, 0.0, -1.0])
    assert int(ids) == 1 and math.isclose(float(lp), float(torch.log_softmax(adjusted, -1)[1]), rel_tol=1e-6)
    ids, _ = sample(logits, [SamplingParams(0.0, logit_bias={3: 10.0})], [make_generator(0)])
    assert int(ids) == 3


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[0.0, 10.0, 10.0, 0.0]])  # eos = 1, stop id 2: overwhelmingly likely
    p = SamplingParams(1.0, min_tokens=3, stop_token_ids=(2,))
    g = make_generator(0)
    for n in range(3):
        ctx = Context.of([[]], [[0] * n], 4, eos_id=1)
        assert {int(sample(logits, [p], [g], ctx)[0]) for _ in range(50)} <= {0, 3}
    ctx = Context.of([[]], [[0] * 3], 4, eos_id=1)
    assert {int(sample(logits, [p], [g], ctx)[0]) for _ in range(50)} & {1, 2}
    # ignore_eos: EOS does not end the request, so min_tokens need not hold it back
    ctx = Context.of([[]], [[]], 4, eos_id=1)
    q = SamplingParams(1.0, min_tokens=3, stop_token_ids=(2,), ignore_eos=True)
    assert 1 in {int(sample(logits, [q], [g], ctx)[0]) for _ in range(50)}


def test_advancing_a_context_equals_building_it_from_the_tokens():
    prompts, outputs = [[1, 2], [3]], [[4], []]
    ctx = Context.of(prompts, outputs, 8)
    ctx.advance(torch.tensor([4, 5]))
    ctx.advance(torch.tensor([6, 5]))
    want = Context.of(prompts, [[4, 4, 6], [5, 5]], 8)
    assert ctx.generated == want.generated == [3, 2]
    assert torch.equal(ctx.counts, want.counts) and torch.equal(ctx.seen, want.seen)


def test_controls_that_need_a_context_refuse_to_run_without_one():
    with pytest.raises(ValueError, match="Context"):
        sample(torch.zeros(1, 4), [SamplingParams(repetition_penalty=1.1)], [make_generator(0)])
    with pytest.raises(ValueError, match="history"):
        ctx = Context.of([[]], [[]], 4, history=False)
        sample(torch.zeros(1, 4), [SamplingParams(presence_penalty=1.0)], [make_generator(0)], ctx)
    with pytest.raises(ValueError, match="logit_bias: token id 9"):
        sample(torch.zeros(1, 4), [SamplingParams(logit_bias={9: 1.0})], [make_generator(0)])


def test_params_round_trip_through_json():
    p = SamplingParams(
        0.5, 3, 0.9, 0.1, 1.2, 0.3, -0.4, logit_bias={7: -100.0, 2: 1.5}, stop_token_ids=(9, 4, 9), ignore_eos=True,
        min_tokens=2,
    )  # fmt: skip
    assert p.logit_bias == ((2, 1.5), (7, -100.0)) and p.stop_token_ids == (4, 9)
    assert SamplingParams(**json.loads(json.dumps(dataclasses.asdict(p)))) == p
    # a JSON object with string keys, as an API body carries it
    assert SamplingParams(logit_bias={"7": -100, "2": 1.5}).logit_bias == p.logit_bias


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-1.0), dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_p=0.0),
        dict(top_p=1.5), dict(top_k=-1), dict(min_p=-0.1), dict(min_p=1.5), dict(repetition_penalty=0.0),
        dict(repetition_penalty=5e-324), dict(repetition_penalty=101.0),
        dict(repetition_penalty=float("nan")), dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
        dict(logit_bias={1: 101.0}), dict(logit_bias={"x": 1.0}), dict(logit_bias=[(1, 1.0), (1, 2.0)]),
        dict(stop_token_ids=(-1,)), dict(min_tokens=-1),
    ],
)  # fmt: skip
def test_invalid_parameters(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


# -- the transform's distribution, for any controls -----------------------------------------------
@st.composite
def batches(draw_):
    V = draw_(st.integers(2, 24))
    B = draw_(st.integers(1, 4))
    tokens = st.lists(st.integers(0, V - 1), max_size=12)
    rows = []
    for _ in range(B):
        params = SamplingParams(
            temperature=draw_(st.sampled_from([0.0, 0.3, 1.0, 2.5])),
            top_k=draw_(st.integers(0, V + 1)),
            top_p=draw_(st.floats(0.05, 1.0)),
            min_p=draw_(st.floats(0.0, 1.0)),
            repetition_penalty=draw_(st.floats(0.5, 3.0)),
            presence_penalty=draw_(st.floats(-2.0, 2.0)),
            frequency_penalty=draw_(st.floats(-2.0, 2.0)),
            logit_bias=draw_(st.dictionaries(st.integers(0, V - 1), st.floats(-100.0, 100.0), max_size=3)),
            stop_token_ids=tuple(draw_(st.lists(st.integers(1, V - 1), max_size=3))),
            ignore_eos=draw_(st.booleans()),
            min_tokens=draw_(st.integers(0, 6)),
        )
        rows.append((params, draw_(tokens), draw_(tokens)))
    scale = draw_(st.floats(0.1, 30.0))
    return V, rows, scale


@examples(150)
@given(batches(), st.integers(0, 2**31))
def test_the_distribution_sums_to_one_and_gives_dropped_tokens_nothing(batch, seed):
    V, rows, scale = batch
    params = [p for p, _, _ in rows]
    # token 0 is EOS; with every other token a stop id, min_tokens would leave nothing to draw
    ctx = Context.of([pr for _, pr, _ in rows], [out for _, _, out in rows], V, eos_id=0)
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(seed)) * scale
    logp, order, _ = transform(logits, params, ctx)
    probs = logp.exp()
    for i, (p, _, out) in enumerate(rows):
        held = {*p.stop_token_ids, *(() if p.ignore_eos else (0,))} if len(out) < p.min_tokens else set()
        if len(held) == V:
            continue
        assert math.isclose(float(probs[i].sum()), 1.0, rel_tol=1e-5)
        by_token = dict(zip(order[i].tolist(), probs[i].tolist(), strict=True))
        assert all(by_token[t] == 0 for t in held)  # held back by min_tokens
        if p.top_k:
            assert sum(q > 0 for q in by_token.values()) <= p.top_k
        d = draw(logits[i : i + 1], [p], [make_generator(seed)], _row(ctx, i))
        assert int(d.ids) not in held and math.isfinite(float(d.logprobs))


def _row(ctx: Context, i: int) -> Context:
    assert ctx.seen is not None and ctx.counts is not None
    return Context([ctx.generated[i]], ctx.seen[i : i + 1], ctx.counts[i : i + 1], ctx.eos_id)


# -- the edges of every control's range -----------------------------------------------------------
FLOAT64_MAX = 1.7976931348623157e308
# each control's bounds, the values next to them, and the float thresholds in between
EDGE_TEMPERATURES = [0.0, 5e-324, 9.99e-6, 1e-5, 1.0, 3.4028234e38, 3.5e38, 1.16e308, FLOAT64_MAX]


@st.composite
def extreme_rows(draw_, V: int):
    return SamplingParams(
        temperature=draw_(st.one_of(st.sampled_from(EDGE_TEMPERATURES), st.floats(0, FLOAT64_MAX))),
        top_k=draw_(st.one_of(st.integers(0, V + 1), st.integers(0, 10**30))),
        top_p=draw_(st.one_of(st.sampled_from([5e-324, 1e-45, 1.0]), st.floats(0, 1, exclude_min=True))),
        min_p=draw_(st.one_of(st.sampled_from([0.0, 5e-324, 1.0]), st.floats(0, 1))),
        repetition_penalty=draw_(st.one_of(st.sampled_from([0.01, 100.0]), st.floats(0.01, 100.0))),
        presence_penalty=draw_(st.one_of(st.sampled_from([-2.0, 2.0, -8.79e-232]), st.floats(-2.0, 2.0))),
        frequency_penalty=draw_(st.one_of(st.sampled_from([-2.0, 2.0]), st.floats(-2.0, 2.0))),
        logit_bias=draw_(
            st.dictionaries(
                st.integers(0, V - 1), st.one_of(st.sampled_from([-100.0, 100.0]), st.floats(-100, 100))
            )
        ),
        stop_token_ids=tuple(draw_(st.lists(st.integers(1, V - 1), max_size=V - 2))),
        ignore_eos=draw_(st.booleans()),
        min_tokens=draw_(st.integers(0, 3)),
    )


@examples(300)
@given(st.data(), st.integers(2, 40), st.floats(0, 1e4), st.integers(0, 2**31))
def test_every_valid_control_gives_finite_logprobs(data, V, scale, seed):
    """Any controls SamplingParams accepts, at the edges of their ranges (temperatures up
    to float64's largest: 1.16e308 once made a held-back token's logit -inf / inf = NaN),
    over logits from 0 to 1e4 in size: the distribution sums to 1, every token it keeps
    has a finite log-prob, and the drawn token's behaviour log-prob is finite and equals
    what `behaviour_logprobs` (replay) computes for it."""
    B = data.draw(st.integers(1, 3))
    params = [data.draw(extreme_rows(V)) for _ in range(B)]
    tokens = st.lists(st.integers(0, V - 1), max_size=8)
    prompts, outputs = [data.draw(tokens) for _ in params], [data.draw(tokens) for _ in params]
    ctx = Context.of(prompts, outputs, V, eos_id=0)  # stop ids are 1.., so token 0 or V-1 is left
    logits = torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * scale
    logp, _, _ = transform(logits, params, ctx)
    assert not logp.isnan().any() and (logp < math.inf).all()
    assert torch.allclose(logp.exp().sum(-1), torch.ones(B), atol=1e-5)
    assert torch.isfinite(logp[:, 0]).all()  # the most probable token always stays
    d = draw(logits, params, [make_generator(seed + i) for i in range(B)], ctx, top=V)
    assert torch.isfinite(d.logprobs).all()
    assert d.top_logprobs is not None and not d.top_logprobs.isnan().any()
    replayed = behaviour_logprobs(logits, params, d.ids, ctx)
    assert torch.allclose(replayed, d.logprobs, rtol=1e-6, atol=1e-6)
