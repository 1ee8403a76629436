"""A stored starting state is parsed, and a finished one encoded, off the engine thread
(issue 39): while either is in progress, the engine goes on stepping every other request.

The model's own `read_state` runs here, gated by an event the test holds: while the gate is
shut, a parse is in progress for as long as the test likes. A fresh request must run to its
end meanwhile; on an engine that parsed on its own thread it would wait behind the parse.
Then the gate opens and the stored request ends with the tokens it gets ungated."""

from __future__ import annotations

import asyncio
import threading

from app.engine import Request
from model.sampling import SamplingParams
from tests.app.engine_requests import engine_for, greedy, new_session, stored
from tests.conftest import TINY
from tests.sensitive import sensitive_model


def test_the_engine_steps_on_while_a_stored_state_is_parsed():
    lm = sensitive_model("transformer-xl", TINY)
    read_state = lm.read_state
    gate, parsing, threads = threading.Event(), threading.Event(), []

    def gated(blob, deltas=()):
        threads.append(threading.current_thread().name)
        parsing.set()
        assert gate.wait(60), "the test never opened the gate"
        return read_state(blob, deltas)

    async def go() -> tuple[list[int], list[int], list[int]]:
        engine = engine_for(lm, cpu_threads=1)
        engine.start()
        try:
            start = stored(await new_session(engine, [5, 6, 7]))
            gate.set()
            ungated = (await greedy(engine, start, [8], max_tokens=6).finished()).token_ids
            gate.clear()
            lm.read_state = gated  # type: ignore[method-assign]
            slow = greedy(engine, start, [8], max_tokens=6)
            assert await asyncio.to_thread(parsing.wait, 30)
            # the parse is held: a fresh request runs to its end all the same
            bos = engine.tokenizer.bos_id
            fresh_req = Request(None, [bos, 9, 10], SamplingParams(temperature=0.0), None, 6, [])
            fresh = await asyncio.wait_for(engine.submit(fresh_req).finished(), timeout=60)
            assert slow.result is None and slow.sent == 0  # (still parsing)
            gate.set()
            return ungated, (await slow.finished()).token_ids, fresh.token_ids
        finally:
            gate.set()
            engine.stop()

    ungated, parsed, fresh = asyncio.run(go())
    assert parsed == ungated and len(fresh) == 6
    assert threads and all(name.startswith("recur-loader") for name in threads), threads


def test_the_engine_steps_on_while_a_finished_state_is_encoded():
    """The other end (app/engine/encoder.py): a done request's state is checked and encoded
    on the encoder thread. The test holds one encoding open; another request's tokens all
    come meanwhile (on an engine that encoded on its own thread, none would), and each
    outcome follows once the gate opens, the held one with the tokens it gets ungated."""
    lm = sensitive_model("transformer-xl", TINY)
    gate, sealing, threads = threading.Event(), threading.Event(), []

    async def go() -> tuple[list[int], list[int], int]:
        engine = engine_for(lm, cpu_threads=1)
        seal = engine.encoder.seal

        def gated(done):
            threads.append(threading.current_thread().name)
            sealing.set()
            assert gate.wait(60), "the test never opened the gate"
            return seal(done)

        engine.start()
        try:
            start = stored(await new_session(engine, [5, 6, 7]))
            ungated = (await greedy(engine, start, [8], max_tokens=6).finished()).token_ids
            engine.encoder.seal = gated  # type: ignore[method-assign]
            held = greedy(engine, start, [8], max_tokens=6)
            assert await asyncio.to_thread(sealing.wait, 30)
            # the encoding is held: a fresh request's every token comes all the same
            bos = engine.tokenizer.bos_id
            fresh = engine.submit(Request(None, [bos, 9, 10], SamplingParams(temperature=0.0), None, 6, []))
            tokens = [await asyncio.wait_for(fresh.__anext__(), timeout=60) for _ in range(6)]
            assert held.result is None and fresh.result is None  # (their outcomes wait their turn)
            gate.set()
            return ungated, (await held.finished()).token_ids, len(tokens)
        finally:
            gate.set()
            engine.stop()

    ungated, held, fresh = asyncio.run(go())
    assert held == ungated and fresh == 6
    assert threads and all(name.startswith("recur-encoder") for name in threads), threads
