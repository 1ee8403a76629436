"""Issue 6 at the engine/store level, with a real Redis: delta persistence rebuilds the
exact state, the hot cache sends no state bytes when Redis confirms it is current and
reloads when another replica moved the session on, and a full queue refuses at once."""

from __future__ import annotations

import asyncio
import secrets

import pytest
import torch
from prometheus_client import REGISTRY

import model
from app.assembly import build_engine, build_sessions, build_tenants
from app.config import Settings
from app.engine import QueueFull, Stored
from app.sessions import Generation
from app.store import Store
from model.sampling import SamplingParams
from model.state import merge, read_blob

from .engine_requests import engine_for, generate, new_session, score, stored

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return model.load(tiny_model_dir, device="cpu")


def _bytes_read() -> float:
    return REGISTRY.get_sample_value("recur_state_bytes_read_total") or 0.0


class Replica:
    """What one server process holds: the sessions service, with its engine, hot cache and
    store client."""

    def __init__(self, lm, redis_url: str, prefix: str, **settings):
        s = Settings(redis_url=redis_url, key_prefix=prefix, **settings)
        self.engine = build_engine(s, lm, "tiny")
        self.store = Store.from_settings(s)
        self.sessions = build_sessions(s, self.store, self.engine, build_tenants(s, self.store))
        self.engine.start()
        self.bytes_read: list[float] = []
        self.commits: list[str] = []
        self.logprobs: list[list[float]] = []

    async def create(self, prompt: list[int]):
        return await self.sessions.create(prompt, 600, "")

    async def generate(self, sid: str, prompt: list[int], max_tokens: int = 5):
        before = _bytes_read()  # (the replicas of a test take turns: no other read counts)
        run = await self.sessions.generate(
            sid, prompt, Generation(GREEDY, max_tokens), expected=None, owner=""
        )
        try:
            events = [ev async for ev in run.stream()]
        finally:
            await run.close()
        tokens = [ev.id for ev in events]
        self.logprobs.append([ev.logprob for ev in events])
        self.bytes_read.append(_bytes_read() - before)
        c = run.result
        assert c.encoded is not None
        self.commits.append(c.encoded.kind)
        return tokens, run.meta, c

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
            sizes.append(len(c.encoded.blob))
        _, blobs = await r.store.sessions.read(meta.id, with_state=True)
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
            sizes[history] = (c.encoded.kind == "delta", len(c.state.delta_bytes(since=meta.n_tokens - 6)))
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
        r = Replica(lm, redis_url, f"scale-{secrets.token_hex(4)}:", hot_cache_mb=0)
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


def test_a_narrower_stored_dtype_continues_the_same_on_every_replica(redis_url):
    """Stored as bfloat16, a state continues exactly as Redis holds it whichever replica
    serves it: hot in the committing replica's cache (rounded through bfloat16, its caches
    rebuilt), or read back from Redis by another replica, or by a fork. (A Mamba state,
    which a commit rounds: a key/value cache keeps its precision itself, as it is
    appended, tests/app/test_state_precision_api.py.)"""
    prefix = f"scale-{secrets.token_hex(4)}:"
    bf16 = dict(state_dtype="bfloat16")
    # the trained model: a random tiny one barely reads its state, so rounding it would
    # move its log-probs by less than fp32 rounding does
    lm = model.load("shakespeare-mamba", device="cpu")
    assert lm.set_state_dtype("bfloat16") == "bfloat16"  # rounded when stored

    async def serve(order: str, **settings):
        replicas = {name: Replica(lm, redis_url, prefix, **bf16, **settings) for name in sorted(set(order))}
        meta = await replicas[order[0]].create(list(b"To be"))
        out = []
        for name in order:
            r = replicas[name]
            tokens, meta, _ = await r.generate(meta.id, list(b", or"), max_tokens=6)
            out.append((tokens, r.logprobs[-1]))
        # a fork of the last commit, continued by the replica that did not commit it
        fork = await replicas[order[-1]].sessions.fork(meta.id, None, "")
        other = replicas[order[0]]
        tokens, _, _ = await other.generate(fork.id, list(b", or"), max_tokens=6)
        forked = (tokens, other.logprobs[-1])
        tokens, _, _ = await replicas[order[-1]].generate(meta.id, list(b", or"), max_tokens=6)
        original = (tokens, replicas[order[-1]].logprobs[-1])
        for r in replicas.values():
            await r.close()
        return out, forked, original

    hot, hot_fork, hot_original = asyncio.run(serve("aababba"))
    cold, cold_fork, cold_original = asyncio.run(serve("aaaaaaa", hot_cache_mb=0))
    for (ids_h, lps_h), (ids_c, lps_c) in zip(
        [*hot, hot_fork, hot_original], [*cold, cold_fork, cold_original], strict=True
    ):
        assert ids_h == ids_c
        # (bfloat16 rounding moves log-probs by ~1e-3; what is left is fp32 rounding)
        assert lps_h == pytest.approx(lps_c, abs=1e-5)
    # the fork continues exactly as its original does
    assert hot_fork[0] == hot_original[0]
    assert hot_fork[1] == pytest.approx(hot_original[1], abs=1e-5)


def test_full_queue_refuses_at_once(lm):
    async def go():
        engine = engine_for(lm, max_queued_requests=2, max_queued_tokens=100)
        state = lm.new_state(1)
        _, state = lm.consume([lm.tokenizer.bos_id], state)
        src = Stored(state.to_bytes(), (), 1)
        # the engine is not started: everything submitted stays queued
        generate(engine, src, [1, 2, 3], GREEDY, seed=None, max_tokens=4, stop=[])
        generate(engine, src, [], GREEDY, seed=None, max_tokens=4, stop=[])
        with pytest.raises(QueueFull):
            generate(engine, src, [], GREEDY, seed=None, max_tokens=4, stop=[])
        with pytest.raises(QueueFull):
            await score(engine, src, [1], keep_state=False)
        engine2 = engine_for(lm, max_queued_requests=10, max_queued_tokens=100)
        generate(engine2, src, [1] * 90, GREEDY, seed=None, max_tokens=4, stop=[])
        with pytest.raises(QueueFull, match="prompt tokens"):
            generate(engine2, src, [1] * 20, GREEDY, seed=None, max_tokens=4, stop=[])
        # once the scheduler admits the queue, there is room again
        engine.start()
        await asyncio.sleep(0)
        for _ in range(200):
            if engine.scheduler.num_waiting == 0:
                break
            await asyncio.sleep(0.01)
        generate(engine, src, [], GREEDY, seed=None, max_tokens=4, stop=[])
        engine.stop()

    asyncio.run(go())


@pytest.mark.slow  # (an inductor compile; make test keeps tests/app/test_compiler.py's fast ones)
def test_compiled_decode_step_matches_eager(lm):
    """The `compile` setting changes speed, never tokens (compiling and probing the tiny
    model on this CPU takes about 20 s; whether the compiled step then serves depends on the
    probe's timing, `tests/app/test_compiler.py` makes sure it does)."""

    async def run(compile: bool):
        # one stream: the batch classes of 1 and 4 rows are all it can use (each class is a
        # graph of its own to compile; tests/app/test_compiler.py probes every class)
        engine = engine_for(lm, compile=compile, max_batch_size=4)
        engine.start()
        while engine.decode_step.status.state == "compiling":  # the eager step would serve meanwhile
            await asyncio.sleep(0.2)
        assert engine.decode_step.status.state in ("off", "ready"), engine.decode_step.status.error
        new = await new_session(engine, list(b"ROMEO:"))
        gen = generate(engine, stored(new), [], GREEDY, seed=None, max_tokens=24, stop=[])
        out = [(ev.id, ev.logprob) async for ev in gen]
        engine.stop()
        return out

    eager, compiled = asyncio.run(run(False)), asyncio.run(run(True))
    assert [i for i, _ in eager] == [i for i, _ in compiled]
    assert max(abs(a - b) for (_, a), (_, b) in zip(eager, compiled, strict=True)) <= 1e-4
