"""A batched step that fails fails only the rows whose own part fails (issue 38's batch faults).

The engine is driven directly (no HTTP, no Redis) on the tiny Transformer-XL, with the
rows queued before it starts so that they share every step. A fault is injected into the
model instance itself: a prefill that raises for a chunk holding one byte, a decode forward
that raises once for a whole batch, a state whose logits are not finite. Each test checks
that the batch it needs really formed, so it cannot pass without exercising the path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import model
from app.engine import Finished, ModelFailed, NonFinite, Request, Stored
from model.sampling import SamplingParams
from model.state import Persist
from tests.app.engine_requests import engine_for
from tests.hostile.states import blob_with, full_state

POISON = ord("~")  # a chunk holding it raises in the prefill
GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [list(b"To be, "), list(b"or not~"), list(b"that is"), list(b"the que")]  # one length: one group


def run_all(lm: model.LanguageModel, make: Callable[[], list[Request]]) -> list[Finished | BaseException]:
    """Queue every request `make` makes (on the loop: a request belongs to one), then start
    the engine, so that they share its steps; their outcomes. A stored start is parsed by the
    engine's loader thread, which delivers it when it is ready: the engine starts only once
    every one was delivered, or the rows would join its steps one by one, as they were parsed."""

    async def go() -> list[Finished | BaseException]:
        engine = engine_for(lm, cpu_threads=1)
        requests = make()
        for r in requests:
            engine.submit(r)
        await asyncio.to_thread(engine.loader.drain)
        engine.start()
        try:
            return await asyncio.gather(*(r.finished() for r in requests), return_exceptions=True)
        finally:
            engine.stop()

    return asyncio.run(go())


def fresh(lm: model.LanguageModel, prompt: list[int], max_tokens: int = 8) -> Request:
    bos = lm.tokenizer.bos_id
    return Request(None, [bos, *prompt], GREEDY, None, max_tokens, [], persist=Persist())


def alone(model_dir: Path, prompt: list[int]) -> list[int]:
    """The tokens `prompt` generates on its own, in an engine of its own (on a model of its own)."""
    lm = model.load(model_dir, device="cpu")
    (res,) = run_all(lm, lambda: [fresh(lm, prompt)])
    assert isinstance(res, Finished), res
    return res.token_ids


def test_a_prefill_batch_that_raises_fails_only_the_row_whose_chunk_raises(tiny_model_dir: Path):
    lm = model.load(tiny_model_dir, device="cpu")
    want = {i: alone(tiny_model_dir, p) for i, p in enumerate(PROMPTS) if POISON not in p}
    batches: list[int] = []
    prefill = lm.prefill

    def faulty(ids, state, logprobs=False, how=model.IN_PLACE):  # type: ignore[no-untyped-def]
        batches.append(ids.shape[0])
        if bool((ids == POISON).any()):
            raise RuntimeError("injected fault: the prefill raised")
        return prefill(ids, state, logprobs, how)

    lm.prefill = faulty  # type: ignore[method-assign]
    results = run_all(lm, lambda: [fresh(lm, p) for p in PROMPTS])
    assert batches[0] == len(PROMPTS)  # the rows shared the step that raised
    assert isinstance(results[1], ModelFailed), results[1]
    for i, ids in want.items():
        res = results[i]
        assert isinstance(res, Finished), res
        assert res.token_ids == ids  # and each continued exactly as it would alone


def test_a_decode_forward_that_raises_once_consumes_each_row_alone(tiny_model_dir: Path):
    lm = model.load(tiny_model_dir, device="cpu")
    prompts = [p for p in PROMPTS if POISON not in p]
    want = [alone(tiny_model_dir, p) for p in prompts]
    raised: list[int] = []
    forward = lm.forward

    def faulty(tokens, state, how=model.IN_PLACE):  # type: ignore[no-untyped-def]
        if tokens.shape[0] > 1 and tokens.shape[1] == 1 and not raised:  # the first batched decode step
            raised.append(tokens.shape[0])
            raise RuntimeError("injected fault: the batched decode forward raised")
        return forward(tokens, state, how)

    lm.forward = faulty  # type: ignore[method-assign]
    results = run_all(lm, lambda: [fresh(lm, p) for p in prompts])
    assert raised == [len(prompts)]
    for res, ids in zip(results, want, strict=True):
        assert isinstance(res, Finished), res
        assert res.token_ids == ids


@pytest.mark.parametrize("bad_at", [0, 1])
def test_a_row_with_non_finite_logits_fails_alone(tiny_model_dir: Path, bad_at: int):
    lm, state = full_state(tiny_model_dir)
    good = Stored(state.to_bytes(), (), int(state.n_tokens[0]))
    bad = Stored(blob_with(tiny_model_dir, fill=3e38), (), int(state.n_tokens[0]))
    with torch.no_grad():
        assert not bool(torch.isfinite(lm.next_logits(lm.load_state(bad.snapshot))).all())
    starts = [good, good, good]
    starts[bad_at] = bad
    sampled: list[int] = []  # the rows of each step's logits
    next_logits = lm.next_logits

    def counted(state):  # type: ignore[no-untyped-def]
        sampled.append(int(state.n_tokens.shape[0]))
        return next_logits(state)

    lm.next_logits = counted  # type: ignore[method-assign]
    results = run_all(lm, lambda: [Request(s, [], GREEDY, None, 6, [], persist=Persist()) for s in starts])
    assert sampled[0] == len(starts)  # the bad row shared its first step with the good ones
    assert isinstance(results[bad_at], NonFinite), results[bad_at]
    for i, res in enumerate(results):
        if i != bad_at:
            assert isinstance(res, Finished) and len(res.token_ids) == 6, res
