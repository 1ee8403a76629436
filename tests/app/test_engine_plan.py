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


class Steps:
    """Takes the engine's steps itself (its thread never starts): each step's plan as
    (prompt chunks as (length, requests), the requests that sample, the rows waiting on a
    prompt and those decoding as it was planned), and the rows that finished, by request."""

    def __init__(self, engine):
        self.engine, self.plans, self.done = engine, [], {}

    def __call__(self) -> None:
        s, runner = self.engine.scheduler, self.engine.runner
        s.receive(wait=False)
        for req in s.admit():
            s.add(runner.load(req))
        waiting, decoding = len(s._prefilling), len(s._decoding)
        plan = s.schedule()
        chunks = [(size, [r.req for r in rows]) for size, rows in plan.prefill]
        self.plans.append((chunks, [r.req for r in plan.decode], waiting, decoding))
        assert not runner.execute(plan)
        for row in s.update([]):
            self.done[id(row.req)] = runner.finish(row)
        self.engine.outbox.flush()

    async def equal_alone(self, lm, requests: list[Request]) -> None:
        """Each request's tokens are those it gets alone, on an engine of its own."""
        self.engine.encoder.close()
        alone = engine_for(lm, cpu_threads=1)
        alone.start()
        try:
            for req in requests:
                ref = alone.submit(_request(alone, req.prompt[1:], req.max_tokens))
                assert self.done[id(req)].row.ids == (await ref.finished()).token_ids
        finally:
            alone.stop()


def test_each_step_runs_the_schedulers_plan():
    lm = sensitive_model("transformer-xl", TINY)

    async def go():
        engine = engine_for(lm, cpu_threads=1, prefill_tokens_per_step=BUDGET)
        step = Steps(engine)

        def plan() -> tuple:  # the last step's chunks and sampling rows
            return step.plans[-1][:2]

        short = engine.submit(_request(engine, [5, 6], max_tokens=8))
        step()  # alone: its whole prompt (3 tokens with BOS) in one chunk, and it samples at once
        assert plan() == ([(3, [short])], [short])
        long = engine.submit(_request(engine, list(range(7, 20)), max_tokens=2))  # 14 with BOS
        score = engine.submit(_request(engine, [21, 22], max_tokens=0))
        # beside one decoding row, two rows wait on their prompts: twice the budget, an equal
        # share each (the score's whole prompt is less than its share)
        step()
        assert plan() == ([(BUDGET, [long]), (3, [score])], [short])
        assert id(score) in step.done and not step.done[id(score)].row.ids  # asked for none: never sampled
        step()  # one waits, one decodes: the budget itself
        assert plan() == ([(BUDGET, [long])], [short])
        step()
        assert plan() == ([(2, [long])], [short, long])  # its prompt ends: it samples now, last
        while len(step.done) < 3:
            step()
        await step.equal_alone(lm, [short, long])

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
        step, seg = Steps(engine), engine.scheduler.prefill.segment_len
        first = engine.submit(_request(engine, [5, 6], max_tokens=12))
        step()  # alone: its whole prompt, and it decodes from here
        lengths = (20, 23, 26)[:waiting]
        burst = [engine.submit(_request(engine, list(range(7, 7 + n)), max_tokens=3)) for n in lengths]
        budget = min(BUDGET * waiting, seg)
        assert seg < BUDGET * 3 and budget >= BUDGET  # (the case of 3 meets the cap)
        for _ in range(3):  # all wait beside one decoding row: an equal share each, one chunk length
            step()
            assert step.plans[-1][0] == [(budget // waiting, burst)]
        while len(step.done) < waiting + 1:
            step()
        for chunks, _, n_waiting, n_decoding in step.plans[1:]:
            if n_decoding:
                cap = max(BUDGET, min(BUDGET * -(-n_waiting // n_decoding), seg))
                assert sum(size * len(rows) for size, rows in chunks) <= cap
        await step.equal_alone(lm, [first, *burst])

    asyncio.run(go())
