"""Issue 6 at the engine/store level, with a real Redis: delta persistence rebuilds the
exact state, the hot cache sends no state bytes when Redis confirms it is current and
reloads when another replica moved the session on, and a full queue refuses at once."""

from __future__ import annotations

import asyncio
import secrets

import pytest
import torch

import model
from app.engine import Engine, QueueFull, StateSource
from app.store import SessionStore, StateBlobs
from model.sampling import SamplingParams
from model.state import merge, read_blob

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return model.load(tiny_model_dir, device="cpu")


class Replica:
    """What one server process holds: an engine (with its hot cache) and a store client."""

    def __init__(self, lm, redis_url: str, prefix: str, **engine_kw):
        self.engine = Engine(lm, name="tiny", **engine_kw)
        self.store = SessionStore(redis_url, key_prefix=prefix)
        self.engine.start()
        self.bytes_read: list[int] = []
        self.commits: list[str] = []

    async def create(self, prompt: list[int]):
        consumed = await self.engine.new_session(prompt)
        meta = await self.store.create(
            StateBlobs(consumed.commit.snapshot), consumed.n_tokens, "tiny", self.engine.fingerprint, ttl=600
        )
        self.engine.remember(meta, consumed.commit)
        return meta

    async def generate(self, sid: str, prompt: list[int], max_tokens: int = 5):
        held = self.engine.held(sid)
        w = await self.store.begin(sid, None, held.commit_id if held else None)
        try:
            self.bytes_read.append(w.state.nbytes if w.state else 0)
            gen = self.engine.generate(
                self.engine.source(w.meta, w.state, held),
                prompt,
                GREEDY,
                seed=None,
                max_tokens=max_tokens,
                stop=[],
            )
            tokens = [ev.id async for ev in gen]
            c = gen.result.commit
            self.commits.append("snapshot" if c.snapshot is not None else "delta")
            meta = await w.commit(c.n_tokens, snapshot=c.snapshot, delta=c.delta)
            self.engine.remember(meta, c)
            return tokens, meta, c
        finally:
            await w.release()

    async def close(self):
        self.engine.stop()
        await self.store.close()


def test_delta_commits_rebuild_the_exact_state(lm, redis_url):
    async def go():
        r = Replica(lm, redis_url, f"scale-{secrets.token_hex(4)}:")
        meta = await r.create(list(b"ROMEO: "))
        sizes = []
        for i in range(12):
            _, meta, c = await r.generate(meta.id, list(b" and"), max_tokens=3 + i % 3)
            sizes.append(c.nbytes)
        _, blobs = await r.store.read(meta.id, with_state=True)
        await r.close()
        return meta, blobs, c, r.commits, sizes

    meta, blobs, last, commits, sizes = asyncio.run(go())
    assert "delta" in commits and commits.count("snapshot") >= 1, commits  # deltas, and compaction
    _, merged = merge(blobs.snapshot, blobs.deltas)
    _, full = read_blob(last.state.to_bytes())
    for name in full:
        assert torch.equal(merged[name], full[name]), name
    assert int(merged["n_tokens"][0]) == meta.n_tokens
    snapshot = len(last.state.to_bytes())
    deltas = [s for s, kind in zip(sizes, commits, strict=True) if kind == "delta"]
    assert max(deltas) < snapshot


def test_delta_size_does_not_grow_with_history(lm, redis_url):
    async def go():
        r = Replica(lm, redis_url, f"scale-{secrets.token_hex(4)}:")
        meta = await r.create([])
        sizes = {}
        for history in (1, 400):
            while meta.n_tokens < history:
                _, meta, _ = await r.generate(meta.id, list(b"x" * 40), max_tokens=1)
            _, meta, c = await r.generate(meta.id, list(b"ab"), max_tokens=4)
            sizes[history] = (c.delta is not None, len(c.state.delta_bytes(since=meta.n_tokens - 6)))
        await r.close()
        return sizes

    sizes = asyncio.run(go())
    # the same number of new tokens costs the same bytes, whatever the history
    assert abs(sizes[1][1] - sizes[400][1]) <= 8


def test_hot_cache_confirms_versions_across_replicas(lm, redis_url):
    prefix = f"scale-{secrets.token_hex(4)}:"

    async def two_replicas():
        a, b = Replica(lm, redis_url, prefix), Replica(lm, redis_url, prefix)
        meta = await a.create(list(b"To be"))
        out = []
        for r in (a, a, b, a, b, b, a):  # "aababba"
            tokens, meta, _ = await r.generate(meta.id, list(b", or"))
            out.append(tokens)
        await a.close()
        await b.close()
        return out, a.bytes_read, b.bytes_read

    async def one_process_no_cache():
        r = Replica(lm, redis_url, f"scale-{secrets.token_hex(4)}:", hot_cache_bytes=0)
        meta = await r.create(list(b"To be"))
        out = []
        for _ in range(7):
            tokens, meta, _ = await r.generate(meta.id, list(b", or"))
            out.append(tokens)
        await r.close()
        return out, r.bytes_read

    out, read_a, read_b = asyncio.run(two_replicas())
    ref, read_ref = asyncio.run(one_process_no_cache())
    assert out == ref  # every handover continued from the latest committed state
    # state bytes read per request: none when this replica's copy is confirmed current,
    # a reload whenever the other replica committed in between (or on first use)
    served = "aababba"
    moved = [i > 0 and served[i - 1] != r for i, r in enumerate(served)]
    expect_a = [m for m, r in zip(moved, served, strict=True) if r == "a"]
    expect_b = [m or i == 2 for i, (m, r) in enumerate(zip(moved, served, strict=True)) if r == "b"]
    assert [n > 0 for n in read_a] == expect_a == [False, False, True, True]
    assert [n > 0 for n in read_b] == expect_b == [True, True, False]
    assert all(n > 0 for n in read_ref)


def test_full_queue_refuses_at_once(lm):
    async def go():
        engine = Engine(lm, name="tiny", max_queued_requests=2, max_queued_tokens=100)
        state = lm.new_state(1)
        _, state = lm.consume([lm.tokenizer.bos_id], state)
        src = StateSource.from_bytes(state.to_bytes(), 1)
        # the scheduler is not started: everything submitted stays queued
        engine.generate(src, [1, 2, 3], GREEDY, seed=None, max_tokens=4, stop=[])
        engine.generate(src, [], GREEDY, seed=None, max_tokens=4, stop=[])
        with pytest.raises(QueueFull):
            engine.generate(src, [], GREEDY, seed=None, max_tokens=4, stop=[])
        with pytest.raises(QueueFull):
            await engine.score(src, [1], keep_state=False)
        engine2 = Engine(lm, name="tiny", max_queued_requests=10, max_queued_tokens=100)
        engine2.generate(src, [1] * 90, GREEDY, seed=None, max_tokens=4, stop=[])
        with pytest.raises(QueueFull, match="prompt tokens"):
            engine2.generate(src, [1] * 20, GREEDY, seed=None, max_tokens=4, stop=[])
        # once the scheduler admits the queue, there is room again
        engine.start()
        await asyncio.sleep(0)
        for _ in range(200):
            if engine.scheduler.queued_requests == 0:
                break
            await asyncio.sleep(0.01)
        engine.generate(src, [], GREEDY, seed=None, max_tokens=4, stop=[])
        engine.stop()

    asyncio.run(go())


@pytest.mark.slow
def test_compiled_decode_step_matches_eager(lm):
    """The `compile` setting changes speed, never tokens (on CPU compiling takes ~1.5 min)."""

    async def run(compile: bool):
        engine = Engine(lm, name="tiny", compile=compile)
        engine.start()
        new = await engine.new_session(list(b"ROMEO:"))
        src = StateSource.from_bytes(new.commit.snapshot, new.n_tokens)
        gen = engine.generate(src, [], GREEDY, seed=None, max_tokens=24, stop=[])
        out = [(ev.id, ev.logprob) async for ev in gen]
        engine.stop()
        return out

    eager, compiled = asyncio.run(run(False)), asyncio.run(run(True))
    assert [i for i, _ in eager] == [i for i, _ in compiled]
    assert max(abs(a - b) for (_, a), (_, b) in zip(eager, compiled, strict=True)) <= 1e-4
