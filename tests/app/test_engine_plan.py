"""One engine step is schedule, execute, update (issue 40): the scheduler's `Plan` says which
rows consume which prompt chunks and which rows sample a token, and the runner runs it.

The test takes the steps itself (the engine's thread never starts) and pins the plan's
fields step by step: a decoding row shares each step with at most `prefill_tokens_per_step`
tokens of a long prompt, taken in chunks; a row whose chunk ends its prompt samples in the
same step, after the rows already decoding; a row that asks for no tokens never samples;
and the tokens each row gets are those it gets alone."""

from __future__ import annotations

import asyncio

import pytest

from app.engine import Request
from model.sampling import SamplingParams
from tests.app.engine_requests import engine_for
from tests.conftest import TINY
from tests.sensitive import sensitive_model

BUDGET = 6  # prefill_tokens_per_step


def _request(engine, prompt: list[int], max_tokens: int) -> Request:
    bos = engine.tokenizer.bos_id
    return Request(None, [bos, *prompt], SamplingParams(temperature=0.0), None, max_tokens, [])


def test_each_step_runs_the_schedulers_plan():
    lm = sensitive_model("transformer-xl", TINY)

    async def go():
        engine = engine_for(lm, cpu_threads=1, prefill_tokens_per_step=BUDGET)
        s, runner = engine.scheduler, engine.runner
        plans, done = [], {}

        def step() -> None:
            s.receive(wait=False)
            for req in s.admit():
                s.add(runner.load(req))
            plan = s.schedule()
            plans.append(
                ([(size, [r.req for r in rows]) for size, rows in plan.prefill], [r.req for r in plan.decode])
            )
            failed = runner.execute(plan)
            assert not failed
            for row in s.update([]):
                done[id(row.req)] = runner.finish(row)
            engine.outbox.flush()

        short = engine.submit(_request(engine, [5, 6], max_tokens=8))
        step()  # alone: its whole prompt (3 tokens with BOS) in one chunk, and it samples at once
        assert plans[-1] == ([(3, [short])], [short])
        long = engine.submit(_request(engine, list(range(7, 20)), max_tokens=2))  # 14 with BOS
        score = engine.submit(_request(engine, [21, 22], max_tokens=0))
        # beside one decoding row, two rows wait on their prompts: twice the budget, an equal
        # share each (the score's whole prompt is less than its share)
        step()
        assert plans[-1] == ([(BUDGET, [long]), (3, [score])], [short])
        assert id(score) in done and not done[id(score)].row.ids  # asked for none: never sampled
        step()  # one waits, one decodes: the budget itself
        assert plans[-1] == ([(BUDGET, [long])], [short])
        step()
        assert plans[-1] == ([(2, [long])], [short, long])  # its prompt ends: it samples now, last
        while len(done) < 3:
            step()
        engine.encoder.close()
        alone = engine_for(lm, cpu_threads=1)
        alone.start()
        try:
            for req in (short, long):
                ref = alone.submit(_request(alone, req.prompt[1:], req.max_tokens))
                assert done[id(req)].row.ids == (await ref.finished()).token_ids
        finally:
            alone.stop()

    asyncio.run(go())


@pytest.mark.parametrize("waiting", [2, 3])
def test_a_burst_of_prompts_takes_the_budget_for_each_waiting_row_per_decoding_row(waiting):
    """Rows arriving together after one already decodes: the step consumes the budget
    times how many wait per decoding row, up to one segment (2 rows: 2 budgets; 3 rows: 3
    budgets would pass the tiny model's 16-token segment), shared in equal chunks, so the
    waiting rows take one forward together (not the budget of one prompt, in turn, one row
    a step); as they start decoding, the budget falls back. The tokens are each row's alone."""
    lm = sensitive_model("transformer-xl", TINY)

    async def go():
        engine = engine_for(lm, cpu_threads=1, prefill_tokens_per_step=BUDGET)
        s, runner = engine.scheduler, engine.runner
        plans, done = [], {}

        def step() -> None:
            s.receive(wait=False)
            for req in s.admit():
                s.add(runner.load(req))
            n_waiting, n_decoding = len(s._prefilling), len(s._decoding)
            plan = s.schedule()
            plans.append(
                ([(size, [r.req for r in rows]) for size, rows in plan.prefill], n_waiting, n_decoding)
            )
            assert not runner.execute(plan)
            for row in s.update([]):
                done[id(row.req)] = runner.finish(row)
            engine.outbox.flush()

        first = engine.submit(_request(engine, [5, 6], max_tokens=12))
        step()  # alone: its whole prompt, and it decodes from here
        lengths = (20, 23, 26)[:waiting]
        burst = [engine.submit(_request(engine, list(range(7, 7 + n)), max_tokens=3)) for n in lengths]
        budget = min(BUDGET * waiting, s.segment_len)
        assert s.segment_len < BUDGET * 3 and budget >= BUDGET  # (the case of 3 meets the cap)
        for _ in range(3):  # all wait beside one decoding row: an equal share each, one chunk length
            step()
            assert plans[-1][0] == [(budget // waiting, burst)]
        while len(done) < waiting + 1:
            step()
        for chunks, n_waiting, n_decoding in plans[1:]:
            if n_decoding:
                cap = max(BUDGET, min(BUDGET * -(-n_waiting // n_decoding), s.segment_len))
                assert sum(size * len(rows) for size, rows in chunks) <= cap
        engine.encoder.close()
        alone = engine_for(lm, cpu_threads=1)
        alone.start()
        try:
            for req in (first, *burst):
                ref = alone.submit(_request(alone, req.prompt[1:], req.max_tokens))
                assert done[id(req)].row.ids == (await ref.finished()).token_ids
        finally:
            alone.stop()

    asyncio.run(go())
