"""The engine on its own (no HTTP, no Redis): batching, cancellation, streamed text."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import model
from app.engine import Stored
from model.sampling import SamplingParams

from .engine_requests import engine_for, generate, greedy, new_session, score, stored

# (the tiny model's segment_len is 16: the longer prompts are consumed in several chunks)
PROMPTS = ["Hi", "To be, or not to be, that is the question", "é€😀 multi-byte", "x" * 40]


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return model.load(tiny_model_dir, device="cpu")


def _params(i: int) -> tuple[SamplingParams, int | None]:
    # greedy rows and seeded sampled rows, with top-k / top-p, in one batch
    return [
        (SamplingParams(temperature=0.0), None),
        (SamplingParams(temperature=0.9, top_k=20), 1),
        (SamplingParams(temperature=1.3, top_p=0.8), 2),
        (SamplingParams(temperature=1.0), 3),
    ][i % 4]


async def _run(lm, together: bool, max_tokens: int = 24):
    engine = engine_for(lm)
    if together:
        # queue every request before the scheduler starts, so they share decode steps;
        # their prompts are consumed chunk by chunk, interleaved with the others' decoding
        bos = lm.new_state(1)
        _, bos = lm.consume([lm.tokenizer.bos_id], bos)
        gens = []
        for i, p in enumerate(PROMPTS):
            params, seed = _params(i)
            gens.append(
                generate(
                    engine,
                    Stored(bos.to_bytes(), (), 1),
                    lm.tokenizer.encode(p),
                    params,
                    seed=seed,
                    max_tokens=max_tokens + i,
                    stop=[],
                )
            )
        engine.start()
        results = await asyncio.gather(*(_collect(g) for g in gens))
    else:
        engine.start()
        results = []
        for i, p in enumerate(PROMPTS):
            new = await new_session(engine, lm.tokenizer.encode(p))
            params, seed = _params(i)
            g = generate(engine, stored(new), [], params, seed=seed, max_tokens=max_tokens + i, stop=[])
            results.append(await _collect(g))
    counters = engine.counters
    engine.stop()
    return results, counters


async def _collect(gen):
    events = [e async for e in gen]
    return events, gen.result


def test_batched_decoding_matches_one_at_a_time(lm):
    alone, stats1 = asyncio.run(_run(lm, together=False))
    batched, stats2 = asyncio.run(_run(lm, together=True))
    assert stats1.max_batch == 1
    assert stats2.max_batch == len(PROMPTS)  # the decode steps really were shared
    for (ev_a, res_a), (ev_b, res_b) in zip(alone, batched, strict=True):
        assert [e.id for e in ev_a] == [e.id for e in ev_b]
        for a, b in zip(ev_a, ev_b, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert res_a.n_tokens == res_b.n_tokens
        la = lm.next_logits(res_a.state)
        lb = lm.next_logits(res_b.state)
        torch.testing.assert_close(la, lb, atol=1e-4, rtol=0)


def test_streamed_text_adds_up_and_state_holds_every_token(lm):
    async def go():
        engine = engine_for(lm)
        engine.start()
        new = await new_session(engine, lm.tokenizer.encode("héllo"))
        g = generate(engine, stored(new), [], SamplingParams(temperature=1.5), seed=7, max_tokens=60, stop=[])
        events, res = await _collect(g)
        engine.stop()
        return new, events, res

    new, events, res = asyncio.run(go())
    assert "".join(e.text for e in events) == res.text == lm.tokenizer.decode(res.token_ids)
    assert [e.index for e in events] == list(range(len(events)))
    assert res.n_tokens == new.n_tokens + len(events)
    # the committed state equals teacher-forcing the same tokens
    st = lm.load_state(stored(new).snapshot)
    _, st = lm.consume(res.token_ids, st)
    torch.testing.assert_close(
        lm.next_logits(st), lm.next_logits(lm.load_state(stored(res).snapshot)), atol=1e-4, rtol=0
    )


def test_stop_string_ends_generation(lm):
    async def go():
        engine = engine_for(lm)
        engine.start()
        new = await new_session(engine, [])
        g = greedy(engine, stored(new), max_tokens=40)
        _, free = await _collect(g)
        # stop on a string the greedy continuation is known to produce
        stop = free.text[3:5]
        g = greedy(engine, stored(new), max_tokens=40, stop=[stop])
        _, stopped = await _collect(g)
        engine.stop()
        return free, stop, stopped

    free, stop, stopped = asyncio.run(go())
    assert stopped.finish_reason == "stop"
    # generation ends with the token that completes the first occurrence of the stop string
    assert stopped.text == free.text[: free.text.index(stop) + len(stop)]


def test_cancelled_generation_leaves_the_batch(lm):
    async def go():
        engine = engine_for(lm)
        engine.start()
        new = await new_session(engine, [])
        g = generate(
            engine, stored(new), [], SamplingParams(temperature=1.0), seed=0, max_tokens=100_000, stop=[]
        )
        got = 0
        async for _ in g:
            got += 1
            if got == 3:
                break
        g.cancel()
        # a score is a request too: once the first has run, the cancelled row has left
        await score(engine, stored(new), [1, 2], keep_state=False)
        t1 = engine.counters.decode_tokens
        await score(engine, stored(new), [1, 2], keep_state=False)
        t2 = engine.counters.decode_tokens
        engine.stop()
        return g, t1, t2

    g, t1, t2 = asyncio.run(go())
    assert t1 == t2 < 100_000
    assert g.result is None


def test_long_prompts_are_chunked_between_decode_steps(lm):
    """A long score runs one segment per scheduler iteration, with the other sessions'
    decode steps in between, and gives the same log-probs as one pass."""
    text = list(("All the world's a stage, and all the men and women merely players. " * 3).encode())
    n_chunks = -(-len(text) // lm.segment_len)
    assert n_chunks >= 8

    async def go():
        engine = engine_for(lm)
        engine.start()
        new = await new_session(engine, [])
        g = greedy(engine, stored(new), max_tokens=100_000)
        await g.__anext__()  # decoding has started
        before = engine.counters.decode_steps
        scored = await score(engine, stored(new), text, keep_state=True)
        during = engine.counters.decode_steps - before
        g.cancel()
        engine.stop()
        return scored, during

    scored, during = asyncio.run(go())
    assert during >= n_chunks - 1
    ref = lm.new_state(1)
    _, ref = lm.consume([lm.tokenizer.bos_id], ref)
    lps, ref = lm.consume(text, ref)
    assert scored.prompt_logprobs == pytest.approx(lps[0].tolist(), abs=1e-4)
    assert scored.n_tokens == 1 + len(text)
    torch.testing.assert_close(
        lm.next_logits(lm.load_state(stored(scored).snapshot)), lm.next_logits(ref), atol=1e-4, rtol=0
    )


def test_the_running_count_never_exceeds_the_batch_limit(lm):
    """`num_running` (the metrics gauge) is read from another thread while the scheduler
    moves rows from prefilling to decoding: it must never count a row twice."""
    seen: list[int] = []

    async def go():
        engine = engine_for(lm, max_batch_size=3)
        engine.start()
        new = await new_session(engine, [])
        gens = [greedy(engine, stored(new), list(p.encode()), max_tokens=12) for p in PROMPTS * 3]
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.0002):
                seen.append(engine.scheduler.num_running)

        watcher = threading.Thread(target=watch)
        watcher.start()
        results = await asyncio.gather(*(_collect(g) for g in gens))
        done.set()
        watcher.join()
        await asyncio.sleep(0.05)
        idle = engine.scheduler.num_running
        engine.stop()
        return results, idle

    results, idle = asyncio.run(go())
    assert all(len(events) == 12 for events, _ in results)
    assert max(seen) == 3 and idle == 0
