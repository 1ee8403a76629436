"""A compile in the process never fails a request, and never changes a result.

torch.fx's tracer patches `nn.Module.__call__` for the whole process while it traces; a
compile traces (AOTAutograd's make_fx, inductor's symbolic_trace) on its own thread, and
an engine forward that ran meanwhile went through the tracer's wrapper and failed
(issue 24: `NameError: module is not installed as a submodule`). Here a trace is held open
on purpose for as long as the test likes, so the overlap is certain, not a matter of luck;
tests/faults/test_defaults_under_load.py runs the real compile under real load.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import model

from .engine_requests import engine_for, new_session, score, stored


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return model.load(tiny_model_dir, device="cpu")


class _HeldOpen(torch.nn.Module):
    """A module whose trace stops inside its forward until released."""

    def __init__(self) -> None:
        super().__init__()
        self.entered, self.released = threading.Event(), threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        self.released.wait(30)
        return x + 1


def test_a_request_served_while_fx_traces_waits_for_the_trace_and_succeeds(lm):
    text = list(b"Whether 'tis nobler in the mind to suffer")

    async def run() -> tuple[list, list]:
        engine = engine_for(lm)
        engine.start()
        try:
            start = stored(await new_session(engine, list(b"To be")))
            before = (await score(engine, start, text, keep_state=False)).prompt_logprobs
            held = _HeldOpen()
            tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(held,), daemon=True)
            tracer.start()  # from here until `released`, nn.Module.__call__ is fx's
            assert held.entered.wait(30)
            pending = asyncio.ensure_future(score(engine, start, text, keep_state=True))
            await asyncio.sleep(0.5)  # the engine has the request; it must wait, not run
            assert not pending.done(), "the engine ran a forward while torch.fx was tracing"
            held.released.set()
            during = (await asyncio.wait_for(pending, 60)).prompt_logprobs
            tracer.join(30)
            return before, during
        finally:
            engine.stop()

    before, during = asyncio.run(run())
    assert len(during) == len(before)
    assert max(abs(a - b) for a, b in zip(before[1:], during[1:], strict=True)) <= 1e-5
