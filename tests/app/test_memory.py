"""The engine hands freed host memory back to the OS (app/engine/malloc.py)."""

from __future__ import annotations

import asyncio
import time

import psutil
import pytest
import torch

import model
from app.engine import engine as engine_module
from app.engine import malloc
from app.engine.malloc import MallocTrimmer

from .engine_requests import engine_for, new_session


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_releases_at_most_once_per_interval_and_when_idle_after_work():
    clock = Clock()
    r = MallocTrimmer(5.0, clock=clock)
    if not r.enabled:
        pytest.skip("no malloc_trim in this C library")
    r.idle()
    assert r.releases == 0  # nothing ran: nothing to give back
    r.worked()
    clock.now = 4.9
    r.worked()
    assert r.releases == 0
    clock.now = 5.0
    r.worked()
    assert r.releases == 1
    r.idle()
    assert r.releases == 1  # nothing ran since
    clock.now = 6.0
    r.worked()
    r.idle()
    assert r.releases == 2


def test_an_interval_of_zero_never_releases():
    clock = Clock()
    r = MallocTrimmer(0.0, clock=clock)
    for t in range(100):
        clock.now = float(t)
        r.worked()
        r.idle()
    assert not r.enabled and r.releases == 0


@pytest.mark.skipif(malloc._TRIM is None, reason="no malloc_trim in this C library")
def test_a_release_gives_fragmented_free_memory_back():
    # tensors below glibc's mmap threshold live in the heap; freeing every other one
    # leaves ~100 MiB free but resident, in holes malloc cannot return on its own
    rss = lambda: psutil.Process().memory_info().rss  # noqa: E731
    torch.set_num_threads(1)
    blocks = [torch.ones(25_000) for _ in range(2_000)]  # 100 KB each
    del blocks[::2]
    before = rss()
    MallocTrimmer(1.0).release()
    after = rss()
    del blocks
    assert before - after > 50 * 2**20, (before, after)


@pytest.mark.skipif(malloc._TRIM is None, reason="no malloc_trim in this C library")
def test_the_scheduler_releases_once_when_the_process_goes_quiet(tiny_model_dir):
    engine = engine_for(model.load(tiny_model_dir, device="cpu"), malloc_trim_interval=3600)
    engine.start()
    try:
        assert engine.trimmer.releases == 0  # nothing has run
        asyncio.run(new_session(engine, list(b"some work")))
        deadline = time.monotonic() + 30
        while engine.trimmer.releases == 0:
            assert time.monotonic() < deadline, "the idle engine never released memory"
            time.sleep(0.05)
        time.sleep(2 * engine_module.IDLE_RELEASE_DELAY)
        assert engine.trimmer.releases == 1  # once per quiet spell, not once per wait
    finally:
        engine.stop()
