"""The request path in docs/ARCHITECTURE.md, asserted: the files its block lists are the files a
traced generate runs now (docs/tools/request_path.py serves the shipped model against the test Redis),
and the script counts what it says it counts."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import ModuleType

import pytest

from docs.tools import request_path as rp


def load_file(path: Path, name: str) -> ModuleType:
    """The Python file at `path` (a fixture this test writes) as a module named `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ROOT = Path(__file__).resolve().parent.parent


def test_architecture_request_path_is_current(redis_url: str) -> None:
    # a process of its own, as `make docs` runs it: the profile hook then sees only its threads
    done = subprocess.run(
        [sys.executable, "-m", "docs.tools.request_path", "--check", "--redis-url", redis_url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, (
        "docs/ARCHITECTURE.md's request path (between the request-path markers) is not the list of "
        "files a traced generate runs now: run `make docs` and commit the result\n"
        + done.stdout
        + done.stderr[-4000:]
    )


def test_recorder_counts_starts_and_crossings_per_side(tmp_path: Path) -> None:
    """On a made-up tree: a generator's and a coroutine's resumptions are no new calls, a call
    within a file is no crossing, threads sort into sides by name, and the thread that
    installed the hook (the client's) is not traced."""
    files = {
        "app/first.py": """
            import asyncio

            def outer(second):
                total = 0
                for x in second.numbers(3):
                    total += helper(x)
                return total + asyncio.run(second.waits())

            def helper(x):
                return x
        """,
        "model/second.py": """
            import asyncio

            def numbers(n):
                for i in range(n):
                    yield i

            async def waits():
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                return 1
        """,
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    first = load_file(tmp_path / "app/first.py", "request_path_first")
    second = load_file(tmp_path / "model/second.py", "request_path_second")

    recorder = rp.Recorder(tmp_path)
    recorder.install()
    try:
        recorder.on = True
        loop_side = threading.Thread(target=first.outer, args=(second,), name="AnyIO worker thread")
        engine = threading.Thread(target=lambda: list(second.numbers(2)), name=rp.ENGINE_THREAD)
        for t in (loop_side, engine):
            t.start()
            t.join()
        assert first.outer(second) == 4  # this thread: not hooked
    finally:
        recorder.uninstall()
    sides = recorder.sides()
    # outer + 3 helpers; numbers and waits once each however often they resume
    assert sides[rp.EVENT_LOOP].calls == {"app/first.py": 4, "model/second.py": 2}
    assert sides[rp.EVENT_LOOP].crossings == 2  # outer -> numbers, outer -> waits (via asyncio)
    assert sides[rp.ENGINE].calls == {"model/second.py": 1}
    assert sides[rp.ENGINE].crossings == 0  # called from outside the tree

    recorder.install()  # a thread of neither side: refused, not counted on one
    try:
        recorder.on = True
        stray = threading.Thread(target=first.helper, args=(1,), name="recur-compile")
        stray.start()
        stray.join()
    finally:
        recorder.uninstall()
    with pytest.raises(RuntimeError, match="recur-compile"):
        recorder.sides()


def test_block_is_checked_and_rewritten_between_its_markers(tmp_path: Path) -> None:
    page = tmp_path / "ARCHITECTURE.md"
    page.write_text(f"# A\n\nbefore\n\n{rp.START}\nhand-written\n{rp.END}\n\nafter\n")
    trace = rp.Trace(
        "tiny",
        {
            rp.EVENT_LOOP: rp.Side({"app/api/sessions.py": 3, "app/store.py": 9}),
            rp.ENGINE: rp.Side({"app/engine/engine.py": 1, "model/state.py": 2}),
        },
    )
    assert not rp.is_current(trace, page)
    rp.write(trace, page)
    assert rp.is_current(trace, page)
    text = page.read_text()
    assert text.startswith("# A\n\nbefore\n\n") and text.endswith("\n\nafter\n")
    words = " ".join(text.split())  # the lists are wrapped
    assert "2 files: `api/sessions.py`, `store.py`." in words
    assert "2 files: `engine/engine.py`, `model/state.py`." in words
    trace.sides[rp.ENGINE].calls["model/family.py"] = 1  # a file the block does not list
    assert not rp.is_current(trace, page)
    page.write_text("# A\n\nno markers\n")
    with pytest.raises(SystemExit):
        rp.write(trace, page)
