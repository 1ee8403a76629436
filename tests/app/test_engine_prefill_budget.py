"""Chunked prefill under a token budget: while a long prompt is consumed, the decoding
streams advance every step (the scheduling is asserted, never a time)."""

from __future__ import annotations

import asyncio

import pytest

import model
from app.config import Settings
from app.engine.scheduler import PREFILL_TOKENS_PER_STEP

from .engine_requests import engine_for, greedy, new_session, score, stored


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return model.load(tiny_model_dir, device="cpu")


def _record(engine) -> list[list[tuple]]:
    """Per engine step, what the runner ran: ("prefill", request ids, chunk length) and
    ("decode", request ids)."""
    steps: list[list[tuple]] = []
    step, prefill, decode = engine._step, engine.runner.prefill, engine.runner.decode

    def stepping(admitted):
        steps.append([])
        step(admitted)

    def prefilling(rows, size):
        steps[-1].append(("prefill", {id(r.req) for r in rows}, size))
        prefill(rows, size)

    def decoding(rows):
        steps[-1].append(("decode", {id(r.req) for r in rows}))
        decode(rows)

    engine._step, engine.runner.prefill, engine.runner.decode = stepping, prefilling, decoding
    return steps


@pytest.mark.parametrize("budget", [5, 16])
def test_decoding_rows_advance_every_step_while_a_long_prompt_is_prefilled(lm, budget):
    text = list(("Now is the winter of our discontent made glorious summer. " * 3).encode())
    assert len(text) > 8 * lm.segment_len

    async def go():
        engine = engine_for(lm)
        engine.scheduler.prefill.tokens_per_step = budget
        steps = _record(engine)
        engine.start()
        new = await new_session(engine, [])
        gens = [greedy(engine, stored(new), max_tokens=100_000) for _ in range(2)]
        for g in gens:
            await g.__anext__()  # both decode
        mark = len(steps)  # the score's steps from here
        scored = await score(engine, stored(new), text, keep_state=True)
        for g in gens:
            g.cancel()
        engine.stop()
        return steps[mark:], scored, {id(g) for g in gens}

    steps, scored, decoders = asyncio.run(go())
    # the long prompt: never more than the budget in a step, so consumed over many steps
    chunks = [w[2] for s in steps for w in s if w[0] == "prefill"]
    assert sum(chunks) == len(text) and max(chunks) <= budget
    assert len(chunks) >= -(-len(text) // budget)
    # every step that consumed part of it also advanced both decoding streams
    for s in steps:
        if any(w[0] == "prefill" for w in s):
            decoded = [w[1] for w in s if w[0] == "decode"]
            assert decoded and decoders <= decoded[0]
    # and chunking changed nothing: the log-probs of one pass
    ref = lm.new_state(1)
    _, ref = lm.consume([lm.tokenizer.bos_id], ref)
    lps, _ = lm.consume(text, ref)
    assert scored.prompt_logprobs == pytest.approx(lps[0].tolist(), abs=1e-4)


def test_with_nothing_decoding_a_prompt_takes_whole_segments(lm):
    text = list(("Once more unto the breach, dear friends, once more. " * 2).encode())

    async def go():
        engine = engine_for(lm)
        engine.scheduler.prefill.tokens_per_step = 5
        steps = _record(engine)
        engine.start()
        new = await new_session(engine, [])
        await score(engine, stored(new), text, keep_state=False)
        engine.stop()
        return steps

    chunks = [w[2] for s in asyncio.run(go()) for w in s if w[0] == "prefill"]
    assert max(chunks) == lm.segment_len


def test_the_setting_defaults_to_the_engines_budget():
    assert Settings().prefill_tokens_per_step == PREFILL_TOKENS_PER_STEP
