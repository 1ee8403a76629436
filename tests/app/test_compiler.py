"""The decode step compiled in the background (app/engine/compiler.py): the eager step serves
until the probe is done, the compiled one then serves only what it was checked on, and it
never changes a result beyond 1e-4. Real models, a real compile (tens of seconds each): in
`make test` on the tiny RLT (the graph is what is compiled, and its ops are the shipped
model's) with the batch class of 1 row; in `make test-slow` the tiny RLT's 4-row class too
(rows of unequal length: 30 s more of compile, 40 s with inductor's cache empty, as on a
fresh clone) and the shipped RLT with all four classes (1, 4, 16, 64: a graph each)."""

from __future__ import annotations

import math

import pytest
import torch

import model
from app.engine.compiler import TOLERANCE, DecodeStep, batch_class
from model import Execution
from tests.model.test_rlt import tiny_rlt

# the tiny RLT in the default suite; the shipped one, whose compile takes minutes on 2 cores, in the slow one
MODELS = ["tiny-rlt", pytest.param("shakespeare-rlt", marks=pytest.mark.slow)]


def _tokens(lm, rows: int) -> torch.Tensor:
    return torch.full((rows, 1), 65, dtype=torch.long)


_BUILT: dict[tuple[str, int], tuple] = {}
# the rows the probe compiles for: every class on the shipped RLT; on the tiny one the class
# of 1 row (each class is a graph of its own: the tiny RLT's 1-row class is 10 s of compile,
# 40 s with inductor's cache empty); the slow suite's tests compile its 4-row class too
MAX_ROWS = {"tiny-rlt": 1, "shakespeare-rlt": 64}
SLOW_ROWS = {name: max(4, rows) for name, rows in MAX_ROWS.items()}


def _compiled(name: str, max_rows: int | None = None) -> tuple:
    """The model and a DecodeStep whose probe is done, once per model and rows for this
    module (each compile takes tens of seconds). margin inf: the compiled step is adopted
    wherever it is equal, so that it surely serves here."""
    key = (name, max_rows or MAX_ROWS[name])
    if key not in _BUILT:
        lm = tiny_rlt() if name == "tiny-rlt" else model.load(name, device="cpu")
        _BUILT[key] = (lm, DecodeStep(lm, compile=True, margin=math.inf, max_rows=key[1]))
    return _BUILT[key]


@pytest.mark.slow  # (an inductor compile per model: 80 s of make test's 10 minutes)
@pytest.mark.parametrize("name", MODELS)  # Transformer-XL: tests/app/test_engine_scale.py
def test_the_compiled_step_takes_over_only_after_its_probe(name):
    lm, step = _compiled(name, SLOW_ROWS[name])
    with torch.no_grad():
        # 20 tokens: the window cache is full, the encoder's and memory's are not
        one = lm.consume([1, *b"ROMEO: what light", 32], lm.new_state(1))[1]
        assert step.status.state == "compiling"
        step(_tokens(lm, 1), one)  # before the probe: the eager forward serves
        assert step.compiled_steps == 0
        step.start()
        step._thread.join(timeout=600)
        assert step.status.state == "ready", step.status.error
        assert (
            set(step.status.verdicts)
            == set(step.classes)
            == {c for c in (1, 4, 16, 64) if c <= SLOW_ROWS[name]}
        )
        for v in step.status.verdicts.values():
            assert v.adopted and v.max_diff <= TOLERANCE
        # 3 rows: the 4-row class; 9: the 16-row class
        served = [r for r in (1, 3, 9) if r <= SLOW_ROWS[name]]
        for rows in served:
            state = lm.stack_states([one] * rows)
            eager, compiled = state, state
            for _ in range(6):  # a few steps: the compiled state must feed the next step
                le, eager = lm.forward(_tokens(lm, rows), eager, model.IN_PLACE)  # as served eagerly
                lc, compiled = step(_tokens(lm, rows), compiled)
                assert (lc - le).abs().max() <= TOLERANCE
                # the compiled code ran (the eager forward, which its guards fall back to,
                # would have grown the state in place, in an arena), though `one` came
                # from an eager prefill, in arenas
                assert eager.arenas and not compiled.arenas
            assert int(compiled.n_tokens[0]) == int(eager.n_tokens[0])
        assert step.compiled_steps == 6 * len(served)


@pytest.mark.slow  # (the tiny RLT's 4-row class: a compile of its own)
@pytest.mark.parametrize("name", MODELS)
def test_rows_of_unequal_length_give_the_eager_logits(name):
    """Rows whose memories are left-padded: shapes and guards the probe did not meet. The
    compiled code serves them, or (its guards refusing) the eager forward does under the
    stance eager_on_recompile, never a compile on the engine thread: the same logits."""
    lm, step = _compiled(name, SLOW_ROWS[name])
    assert step.classes[-1] >= 4  # (two rows: the 4-row class serves them)
    with torch.no_grad():
        short = lm.consume([1, *b"To be"], lm.new_state(1))[1]
        long = lm.consume([1, *b"To be, or not to be, that is"], lm.new_state(1))[1]
        if step.status.state == "compiling":  # this test runs alone
            step.start()
            step._thread.join(timeout=600)
        assert step.status.state == "ready", step.status.error
        state = lm.stack_states([short, long])
        lc, _ = step(_tokens(lm, 2), state)
        le, _ = lm.forward(_tokens(lm, 2), state)
        assert (lc - le).abs().max() <= TOLERANCE


def test_off_means_the_eager_step_and_no_thread():
    lm = model.load("shakespeare", device="cpu")
    step = DecodeStep(lm, compile=False)
    step.start()
    assert step.status.state == "off" and step._thread is None
    assert [batch_class(n) for n in (1, 2, 4, 5, 16, 17, 64, 65)] == [1, 4, 4, 16, 16, 64, 64, 64]
    assert DecodeStep(lm, compile=False, max_rows=8).classes == (1, 4, 8)
    assert DecodeStep(lm, compile=False, max_rows=1).classes == (1,)
    assert DecodeStep(lm, compile=False, max_rows=256).classes == (1, 4, 16, 64)


@pytest.mark.parametrize("name", MODELS)
def test_prefills_run_the_models_compiled_parts_once_adopted(name):
    """RLT's per-token recurrence (`LanguageModel.parts`), compiled in the same background
    thread: a prefill run by `DecodeStep.prefill` runs it once the probe adopted it, with the
    eager log-probs (1e-4), alone and as two rows of unequal history."""
    lm, step = _compiled(name)
    with torch.no_grad():
        if step.status.state == "compiling":  # this test runs alone
            step.start()
            step._thread.join(timeout=600)
        prefill = step.status.prefill
        assert prefill is not None and prefill.adopted and prefill.max_diff <= TOLERANCE
        calls = []

        def counted(*args):
            calls.append(1)
            return step._parts["decode_token"](*args)

        short = lm.consume([1, *b"To be"], lm.new_state(1))[1]
        long = lm.consume([1, *b"To be, or not to be, that is the question"], lm.new_state(1))[1]
        ids = torch.tensor([list(b"Whether 'tis nobler in the mind")] * 2)
        for state in (long, lm.stack_states([short, long])):
            x = ids[: state.batch_size]
            eager, _ = lm.prefill(x, state, logprobs=True)

            def both(how, x=x, state=state):  # the served prefill, then once more counting the part's calls
                compiled, _ = lm.prefill(x, state, True, how)
                lm.prefill(x, state, how=Execution(parts={"decode_token": counted}))
                return compiled

            compiled = step.prefill(both)
            assert (compiled - eager).abs().nan_to_num().max() <= TOLERANCE
            assert len(calls) == x.shape[1]  # one call per token: the fixed-shape loop ran
            calls.clear()
    shakespeare = model.load("shakespeare", device="cpu")
    assert shakespeare.parts() == {}  # Transformer-XL prefills a chunk at once: nothing to compile
