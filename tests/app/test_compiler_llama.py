"""The LLaMA family's decode step compiled by the engine's background probe
(app/engine/compiler.py), step after step while the window (40) fills and then slides, from a
state an eager prefill left in arenas. A tiny LLaMA (2 layers, 2 sinks) and the batch class of
one row: one graph, about 20 s of compile on 2 cores; int8's in `make test-slow`. The shipped
smollm2's compile takes minutes: bench/llm_packed.py measures it.

  * fp32: adopted, and the eager step's logits within the probe's `TOLERANCE`.
  * packed int8 and int4 weights (bfloat16 activations into torch's weight-only kernels,
    model/int8.py, model/int4.py): the step compiles through the packed kernels and the cache
    with no graph break, and agrees with the eager step within bfloat16's tolerance, the bound
    the packed path's own boundary invariance holds to (tests/model/test_packed.py), not
    within `TOLERANCE`: a layer's input is rounded to bfloat16, and a last-bit difference in
    the fp32 sums before it (inductor orders a norm's reduction its own way) moves an input
    by one bfloat16 step. The probe refuses such a step wherever it sees that (the engine
    then serves eagerly); it may not see it on its few probe states, so this test calls the
    compiled step directly."""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

import model
from app.engine.compiler import TOLERANCE, DecodeStep
from tests.model.test_packed import tiny

PRECISIONS = ["fp32", "int4", pytest.param("int8", marks=pytest.mark.slow)]
BF16 = 0.05  # |log-prob| bound of the packed path's own boundary invariance (tests/model/test_packed.py)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_compiled_llama_step_gives_the_eager_logits(precision):
    lm = tiny(seed=3)
    if precision != "fp32":
        lm.quantize(precision)
    # margin inf: adopted wherever it is within TOLERANCE, however fast, so that it surely serves here
    step = DecodeStep(lm, compile=True, margin=math.inf, max_rows=1)
    breaks = sum(counters["graph_break"].values())
    step.start()
    assert step._thread is not None
    step._thread.join(timeout=600)
    assert step.status.state == "ready", step.status.error
    assert sum(counters["graph_break"].values()) == breaks  # one graph: no break on the kernels or the cache
    if precision == "fp32":
        verdict = step.status.verdicts[1]
        assert verdict.adopted and verdict.max_diff <= TOLERANCE and step.serves_compiled(1)
    forward = step if precision == "fp32" else step._compiled  # packed: the compiled code, adopted or not
    assert forward is not None
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(1))
    tok = torch.full((1, 1), 7, dtype=torch.long)
    with torch.no_grad():
        _, state = lm.consume(ids, lm.new_state(1))  # an eager prefill: its window in an arena
        eager = compiled = state
        for _ in range(20):
            le, eager = lm.forward(tok, eager, model.IN_PLACE)
            lc, compiled = forward(tok, compiled)
            if precision == "fp32":
                assert (lc - le).abs().max() <= TOLERANCE
            else:
                assert (lc.log_softmax(-1) - le.log_softmax(-1)).abs().max() <= BF16
                assert torch.equal(lc.argmax(-1), le.argmax(-1))
            assert torch.equal(compiled.n_tokens, eager.n_tokens)
            tok = le.argmax(-1)
    if precision == "fp32":
        assert step.compiled_steps == 20
    # the compiled code served every step (an eager forward would have grown the state in an
    # arena; a guard that refused a state would have compiled again, or run eagerly)
    assert not compiled.arenas and eager.arenas
    assert compiled["k"].shape == eager["k"].shape == (1, 2, 40, 32)
