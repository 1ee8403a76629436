"""The files one generate request runs through, measured: a real server in this process, one
streamed `POST /v1/sessions/{id}/generate` traced with a profile hook, and the files of app/
and model/ whose functions ran for it, on each side of the engine's queue.

    python -m docs.tools.request_path            # print the trace: files in first-visit order, calls, crossings
    python -m docs.tools.request_path --write    # rewrite the request-path block of docs/ARCHITECTURE.md (`make docs`)
    python -m docs.tools.request_path --check    # exit 1 if that block is out of date

The two sides are the event loop (uvicorn's thread and the worker threads it hands blocking
calls to) and the engine's threads (`recur-engine`, and the loader and encoder threads that
parse stored states and encode finished ones for it); app/ or model/ code on any other thread
fails the trace rather than be counted on a side it does not belong to. A call counts when a
function starts, not each time a coroutine or generator resumes; a crossing is a call whose
nearest caller in app/ or model/ lies in another file (a call from outside, such as the event
loop running a callback, is no crossing). The block lists only the files, which do not vary
from run to run; the counts do (a lock renewal, say), so only this report prints them.

Everything that could change the path is pinned: the settings' defaults (the environment is
not read), CPU, greedy sampling, and a warm-up request first, so that the traced one finds its
session's state in the hot cache and pays no first-call costs. One default is turned off:
`compile`, whose compiled decode step takes over in the background when a probe finds it
faster, so that with it on the path would depend on the machine and the moment (and the
background compile would run model/ code on a thread of neither side).

This script starts a Redis (unless given one) and a server on 127.0.0.1, and writes only
docs/ARCHITECTURE.md. It must never patch app/ or model/ nor give the server a setting a
deployment would not have: what it measures is the service as shipped.
"""

from __future__ import annotations

import argparse
import contextlib
import dis
import itertools
import os
import re
import secrets
import sys
import tempfile
import textwrap
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # a script run from anywhere still imports this tree's app and model

import httpx  # noqa: E402
import uvicorn  # noqa: E402
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource  # noqa: E402

import model  # noqa: E402
from app.api import create_app  # noqa: E402
from app.config import Settings  # noqa: E402
from app.embedded_redis import EmbeddedRedis, free_port  # noqa: E402

PACKAGES = ("app", "model")
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
START = "<!-- request-path:start -->"
END = "<!-- request-path:end -->"
MODEL = ROOT / "model" / "weights" / "shakespeare"
ENGINE_THREAD = "recur-engine"  # the name app/engine/engine.py gives its thread
# the engine's side: its thread, and the loader's and the encoder's (app/engine/loader.py, encoder.py)
ENGINE_THREADS = (ENGINE_THREAD, "recur-loader", "recur-encoder")
# the threads of the event loop's side: the server's own, AnyIO's workers (FastAPI's sync
# dependencies) and the loop's default executor (asyncio.to_thread)
LOOP_THREADS = ("request-path-server", "AnyIO worker thread", "asyncio_")
EVENT_LOOP, ENGINE = "event loop", "engine thread"
TOKENS = 8  # a prefill and several decode steps
TIMEOUT = 120.0  # seconds for any one step (start, request); a slow machine is no reason to fail


# ---- the profile hook


@dataclass
class Side:
    """What ran on one side: its files in first-visit order with their calls, and the crossings."""

    calls: dict[str, int] = field(default_factory=dict)
    crossings: int = 0

    @property
    def files(self) -> list[str]:
        return list(self.calls)


@dataclass
class _Thread:
    name: str
    first: dict[str, int] = field(default_factory=dict)  # file -> when the process first saw it here
    calls: dict[str, int] = field(default_factory=dict)
    crossings: int = 0


class Recorder:
    """A profile hook on every thread started after `install`: while `on`, it counts the
    calls into app/ and model/ of each thread; `sides` merges the threads into the two sides.

    Each thread writes only its own record, so the hook takes no lock; the order of first
    visits across threads comes from one counter, whose `next` the GIL keeps atomic."""

    def __init__(self, root: Path = ROOT):
        self.on = False
        self._root = root
        self._dirs = tuple(str(root / p) + os.sep for p in PACKAGES)
        self._paths: dict[str, str | None] = {}  # a code object's file -> its path under root, if ours
        self._resume: dict[types.CodeType, int] = {}
        self._clock = itertools.count()
        self._threads: list[_Thread] = []
        self._local = threading.local()  # not a dict by thread id: a finished thread's id is reused

    def install(self) -> None:
        # threading's hook, not sys.setprofile: this thread is the client, not the server
        threading.setprofile(self._hook)

    def uninstall(self) -> None:
        self.on = False
        threading.setprofile(None)

    def _path(self, filename: str) -> str | None:
        if filename not in self._paths:
            ours = filename.startswith(self._dirs)
            self._paths[filename] = Path(filename).relative_to(self._root).as_posix() if ours else None
        return self._paths[filename]

    def _starts(self, frame: types.FrameType) -> bool:
        """Whether this 'call' event starts the function, rather than resume a coroutine or a
        generator (which the hook also reports as a call). A fresh frame has run nothing past
        its first RESUME instruction (Python 3.11+; before that, nothing at all: -1)."""
        code = frame.f_code
        offset = self._resume.get(code)
        if offset is None:
            resume = (i.offset for i in dis.get_instructions(code) if i.opname == "RESUME")
            offset = self._resume[code] = next(resume, -1)
        return frame.f_lasti <= offset

    def _hook(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return
        path = self._path(frame.f_code.co_filename)
        if path is None or not self._starts(frame):
            return
        mine: _Thread | None = getattr(self._local, "record", None)
        if mine is None:
            mine = self._local.record = _Thread(threading.current_thread().name)
            self._threads.append(mine)
        if path not in mine.first:
            mine.first[path] = next(self._clock)
        mine.calls[path] = mine.calls.get(path, 0) + 1
        caller: types.FrameType | None = frame.f_back
        while caller is not None and self._path(caller.f_code.co_filename) is None:
            caller = caller.f_back
        if caller is not None and self._path(caller.f_code.co_filename) != path:
            mine.crossings += 1

    def sides(self) -> dict[str, Side]:
        first: dict[str, dict[str, int]] = {EVENT_LOOP: {}, ENGINE: {}}
        sides = {EVENT_LOOP: Side(), ENGINE: Side()}
        strays = sorted(
            {t.name for t in self._threads if not t.name.startswith((*ENGINE_THREADS, *LOOP_THREADS))}
        )
        if strays:
            raise RuntimeError(f"app/ or model/ code ran on threads of neither side: {', '.join(strays)}")
        for t in self._threads:
            name = ENGINE if t.name.startswith(ENGINE_THREADS) else EVENT_LOOP
            side, seen = sides[name], first[name]
            for path, n in t.calls.items():
                seen[path] = min(seen.get(path, t.first[path]), t.first[path])
                side.calls[path] = side.calls.get(path, 0) + n
            side.crossings += t.crossings
        for name, side in sides.items():
            side.calls = {p: side.calls[p] for p in sorted(side.calls, key=first[name].__getitem__)}
        return sides


# ---- the server


class _Answered:
    """The app, counting the HTTP requests it has finished: after the response, its background
    task and the middleware's bookkeeping, none of which a client sees end."""

    def __init__(self, app: Any):
        self.app = app
        self.count = 0
        self._cond = threading.Condition()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            if scope["type"] == "http":
                with self._cond:
                    self.count += 1
                    self._cond.notify_all()

    def wait(self, count: int) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.count >= count, TIMEOUT):
                raise TimeoutError(f"the server did not finish request {count} in {TIMEOUT:.0f}s")


class _Defaults(Settings):
    """The settings from the arguments alone: a RECUR_ variable in the caller's environment
    must not change the path measured."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """uvicorn on a thread of its own, lifespan and all (the engine starts in it), as `recur
    serve` runs it; yields the base URL. (tests/conftest.py's `serve_in_process` serves
    without the lifespan, for routes that need no engine.)"""
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=LOOP_THREADS[0], daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + TIMEOUT
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (its log is above)")
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


# ---- the trace


@dataclass
class Trace:
    model: str
    sides: dict[str, Side]


def _generate(client: httpx.Client, app: _Answered, session: str, prompt: str) -> None:
    """One streamed generate, read to its end; returns once the server has finished with it."""
    answered = app.count
    body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "stream": True}
    with client.stream("POST", f"/v1/sessions/{session}/generate", json=body) as response:
        events = [line for line in response.iter_lines() if line.startswith("event:")]
    app.wait(answered + 1)
    if response.status_code != 200 or events[-1:] != ["event: done"]:
        raise RuntimeError(f"the generate failed: {response.status_code}, events {events}")


def _wait_quiet(engine: Any) -> None:
    """Wait until the engine has handed back the memory the warm-up freed, which it does once
    it has been idle a while (app/engine/malloc.py): the traced request then finds it waiting,
    as after any quiet spell, and that release never falls inside the trace."""
    deadline = time.monotonic() + TIMEOUT
    while engine.trimmer.pending:
        if time.monotonic() > deadline:
            raise TimeoutError("the engine did not go quiet after the warm-up")
        time.sleep(0.05)


def trace(model_dir: Path = MODEL, redis_url: str | None = None) -> Trace:
    """Serve `model_dir`, warm up, and trace one streamed generate."""
    lm = model.load(model_dir, device="cpu")
    recorder = Recorder()
    with contextlib.ExitStack() as stack:
        if redis_url is None:
            redis = EmbeddedRedis(stack.enter_context(tempfile.TemporaryDirectory()))
            redis_url = redis.start()
            stack.callback(redis.stop)
        given: dict[str, Any] = {
            "model": str(model_dir),
            "redis_url": redis_url,
            "device": "cpu",
            "compile": False,
            "key_prefix": f"request-path-{secrets.token_hex(4)}:",  # a shared Redis keeps its keys apart
        }
        settings = _Defaults(**given)
        app = _Answered(create_app(settings, lm))
        # before the server's and the engine's threads start: a running thread cannot be hooked
        recorder.install()
        stack.callback(recorder.uninstall)
        client = httpx.Client(base_url=stack.enter_context(serving(app)), timeout=TIMEOUT)
        stack.enter_context(client)
        created = client.post("/v1/sessions", json={"prompt": "ROMEO:"}).raise_for_status()
        session = created.json()["id"]
        _generate(client, app, session, " a")  # the warm-up
        _wait_quiet(app.app.state.services.engine)
        recorder.on = True
        try:
            _generate(client, app, session, " Hello")
        finally:
            recorder.on = False
        client.delete(f"/v1/sessions/{session}").raise_for_status()
    sides = recorder.sides()
    for name, side in sides.items():
        if not side.calls:  # a hook installed too late, or a renamed thread: never a valid picture
            raise RuntimeError(f"nothing ran on the {name} side: the trace saw no thread of it")
    return Trace(model_dir.name, sides)


# ---- the block in docs/ARCHITECTURE.md


def label(path: str) -> str:
    """The names ARCHITECTURE.md uses: `api/native/sessions.py` for app/api/native/sessions.py, `model/state.py`."""
    return path.removeprefix("app/")


def _files(side: str, which: str, files: list[str]) -> str:
    text = f"- **{side}** ({which}), {len(files)} files: " + ", ".join(f"`{label(p)}`" for p in files) + "."
    return textwrap.fill(text, width=96, subsequent_indent="  ", break_on_hyphens=False)


def section(t: Trace) -> str:
    """What belongs between the markers in docs/ARCHITECTURE.md."""
    return "\n".join(
        [
            "<!-- generated by `make docs` (docs/tools/request_path.py) from a traced request: edit the code, not this -->",
            "",
            "The files a reader opens for these hops, measured: `make docs` serves the shipped",
            f"`{t.model}` model in one process (on CPU, the decode step eager), sends one streamed generate",
            f"({TOKENS} greedy tokens) to a session that the request before it left in the hot cache, and",
            "lists each file of `app/` and `model/` whose functions ran for it, on each side of the",
            "engine's queue, in the order the request first reached them.",
            "",
            _files("The event loop", "uvicorn's thread and its worker threads", t.sides[EVENT_LOOP].files),
            _files("The engine's threads", f"`{ENGINE_THREAD}`, and its encoder", t.sides[ENGINE].files),
        ]
    )


def _split(text: str) -> tuple[str, str, str] | None:
    """(before the start marker, between the markers, from the end marker on), if both are there."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        return None
    return text[: start + len(START)], text[start + len(START) : end], text[end:]


def is_current(t: Trace, path: Path = ARCHITECTURE) -> bool:
    """Whether the file's request-path block is what the trace gives now."""
    parts = _split(path.read_text()) if path.exists() else None
    return parts is not None and _files_by_side(parts[1]) == _files_by_side(section(t))


def _files_by_side(block: str) -> list[set[str]]:
    """Each side's files as the block lists them. As sets: the order of first visits on the
    event loop's side depends on how its worker threads happen to interleave."""
    return [set(re.findall(r"`([\w/]+\.py)`", bullet)) for bullet in block.split("\n- **")[1:]]


def write(t: Trace, path: Path = ARCHITECTURE) -> None:
    """Rewrite the block between the markers, which must be there: where it goes is the page's call."""
    parts = _split(path.read_text())
    if parts is None:
        raise SystemExit(f"{path}: no {START} ... {END} markers; put them where the block belongs")
    before, _, after = parts
    path.write_text(f"{before}\n{section(t)}\n{after}")


def report(t: Trace) -> str:
    out = [f"one streamed generate ({t.model}, {TOKENS} greedy tokens), traced; files in first-visit order"]
    for name, side in t.sides.items():
        out.append(
            f"\n{name}: {len(side.calls)} files, {sum(side.calls.values())} calls, "
            f"{side.crossings} crossings from one file into another"
        )
        out += [f"  {n:7d}  {p}" for p, n in side.calls.items()]
    files = set(t.sides[EVENT_LOOP].calls) | set(t.sides[ENGINE].calls)
    crossings = sum(s.crossings for s in t.sides.values())
    out.append(f"\nboth sides: {len(files)} files, {crossings} crossings")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--model", type=Path, default=MODEL, help="checkpoint directory (default: shakespeare)"
    )
    parser.add_argument("--redis-url", help="a Redis to use (default: start one in a temporary directory)")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", action="store_true", help=f"rewrite the block in {ARCHITECTURE.name}")
    group.add_argument("--check", action="store_true", help=f"exit 1 if {ARCHITECTURE.name} is out of date")
    args = parser.parse_args(argv)
    t = trace(args.model.resolve(), args.redis_url)
    where = ARCHITECTURE.relative_to(ROOT)
    if args.write:
        write(t)
        print(f"wrote the request path into {where}")
    elif args.check:
        if not is_current(t):
            print(f"{where}: the request path is out of date; run `make docs`. Traced now:\n\n{section(t)}")
            return 1
        print(f"{where}: the request path is up to date")
    else:
        print(report(t))
    return 0


if __name__ == "__main__":
    sys.exit(main())
