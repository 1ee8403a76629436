"""The engine's OpenMP workers are the only ones (app/engine/openmp.py).

With a second thread's pool of OpenMP workers alive, libgomp counts more workers than CPUs and
stops spinning between parallel regions: every region of a decode step then ends with the
engine's threads asleep on a futex, and the 16-stream server ran at half its speed (50-54
against 99-102 tokens/s, docs/BENCHMARKS.md). The checks count threads and read each thread's
settings; they never time anything. Each runs in a fresh interpreter, whose threads are its own.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from app.engine import openmp

pytestmark = pytest.mark.skipif(openmp.runtime()[0] is None, reason="no OpenMP runtime in this process")

COUNT = """
import glob, time, threading
import torch

def threads():
    return len(glob.glob("/proc/self/task/*"))

def settled(expected):
    deadline = time.monotonic() + 5  # (a released worker exits on its own time)
    while threads() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads()

def parallel():
    (torch.randn(4_000_000) * 2).sum()  # a parallel region: this thread's pool of workers

torch.set_num_threads(2)
"""


def _run(code: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", COUNT + textwrap.dedent(code)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_a_thread_that_steps_aside_gives_back_its_workers_and_starts_none():
    out = _run(
        """
        from app.engine import openmp
        base = threads()
        parallel()
        with_pool = threads()
        print("aside", openmp.step_aside())
        print("pool", with_pool - base, "after", settled(base) - base, "own", torch.get_num_threads())
        parallel()
        a = torch.randn(512, 512)
        a @ a  # MKL's product keeps a thread count of its own
        print("again", threads() - base)

        def engine():
            parallel()
            print("engine", torch.get_num_threads(), threads() - base)

        t = threading.Thread(target=engine)
        t.start()
        t.join()
        """
    )
    assert out.split("\n")[:4] == ["aside True", "pool 1 after 0 own 1", "again 0", "engine 2 2"], out


def test_starting_the_engine_leaves_the_cores_to_it(tiny_model_dir):
    """The thread that starts an engine (the event loop's, which loaded the model) keeps no
    workers: without `step_aside` in `Engine.start`, its pool from the model's loading stays."""
    out = _run(
        f"""
        import model
        from app.config import Settings
        from app.assembly import build_engine
        lm = model.load({str(tiny_model_dir)!r}, device="cpu")
        parallel()
        engine = build_engine(Settings(redis_url="redis://unused", cpu_threads=2), lm, "tiny")
        engine.start()
        try:
            print("starter", torch.get_num_threads())
        finally:
            engine.stop()
        """
    )
    assert out.split("\n")[0] == "starter 1", out
