"""One engine step is schedule, execute, update (issue 40): the scheduler's `Plan` says which
rows consume which prompt chunks and which rows sample a token, and the runner runs it.

The test takes the steps itself (the engine's thread never starts) and pins the plan's
fields step by step: a decoding row shares each step with at most `prefill_tokens_per_step`
tokens of a long prompt, taken in chunks; a row whose chunk ends its prompt samples in the
same step, after the rows already decoding; a row that asks for no tokens never samples;
and the tokens each row gets are those it gets alone."""

from __future__ import annotations

import asyncio

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
        step()  # beside a decoding row: the budget, in turn (the long prompt first, then the score)
        assert plans[-1] == ([(BUDGET, [long])], [short])
        step()
        # the score's whole prompt (3), then the rest of the budget to the long one: one chunk length
        assert plans[-1] == ([(3, [score, long])], [short])
        assert id(score) in done and not done[id(score)].row.ids  # asked for none: never sampled
        step()
        assert plans[-1] == ([(5, [long])], [short, long])  # its prompt ends: it samples now, last
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
