"""`python -m app` (`recur serve`) as a user meets it in the first hour, as real processes:
Ctrl-C in the terminal during a live stream, and the setup mistakes that must each end in
one clear line and an exit code, never a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tests.app.sse_client import events
from tests.conftest import ROOT, free_port


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECUR_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _interruptible() -> None:
    """SIGINT at its default in the server (a test worker may have it ignored or blocked)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _serve(model_dir: Path, workdir: Path, *flags: str) -> subprocess.Popen:
    """`python -m app` in a session (process group) of its own, as a terminal runs it."""
    return subprocess.Popen(
        [sys.executable, "-m", "app", "--model", str(model_dir), *flags],
        cwd=workdir,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=_interruptible,
    )


def _ready(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server never became ready")


def _fails_with_one_line(model_dir: Path, workdir: Path, *flags: str, says: str) -> None:
    proc = _serve(model_dir, workdir, "--port", str(free_port()), *flags)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2, stderr
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("recur serve:")]
    assert len(lines) == 1 and says in lines[0], stderr


def test_ctrl_c_ends_a_live_stream_with_its_error_event_then_stops_redis(tiny_model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(tiny_model_dir, tmp_path, "--port", str(port), "--max-tokens", "200000")
    stderr: list[str] = []
    try:
        _ready(url, proc)
        threading.Thread(target=lambda: stderr.append(proc.stderr.read()), daemon=True).start()  # type: ignore[union-attr]
        sid = httpx.post(url + "/v1/sessions", json={"prompt": "abc"}).json()["id"]
        seen: list[tuple[str, dict]] = []
        # on_disconnect=commit: the tokens sent are committed as the stream ends, which
        # needs Redis then: it must outlive the streams
        body = {"max_tokens": 200_000, "temperature": 0, "on_disconnect": "commit"}
        with httpx.stream("POST", f"{url}/v1/sessions/{sid}/generate", json=body, timeout=60) as r:
            for name, data in events(r):
                seen.append((name, data))
                if len(seen) == 20:  # a live stream: Ctrl-C, as the terminal sends it, to the group
                    os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    name, data = seen[-1]
    assert name == "error" and data["error"]["type"] == "not_ready", seen[-3:]
    assert "shutting down" in data["error"]["message"]
    assert all(n == "token" for n, _ in seen[:-1])
    time.sleep(0.5)  # (the reader thread's last read)
    assert "Traceback" not in "".join(stderr)
    # Redis was stopped by the server, last, not by the terminal's SIGINT ...
    redis_log = (tmp_path / "data" / "redis.log").read_text()
    assert "SIGTERM" in redis_log and "SIGINT" not in redis_log, redis_log[-1000:]
    # ... so the tokens the client saw were committed, and are there after a restart
    port = free_port()
    again = _serve(tiny_model_dir, tmp_path, "--port", str(port))
    try:
        _ready(f"http://127.0.0.1:{port}", again)
        s = httpx.get(f"http://127.0.0.1:{port}/v1/sessions/{sid}").json()
        assert (s["version"], s["n_tokens"]) == (1, 4 + len(seen) - 1), s
    finally:
        os.killpg(again.pid, signal.SIGTERM)
        again.wait(timeout=60)


def test_a_malformed_redis_url_is_one_line(tiny_model_dir, tmp_path):
    _fails_with_one_line(tiny_model_dir, tmp_path, "--redis-url", "localhost:6379", says="is malformed")
    _fails_with_one_line(
        tiny_model_dir,
        tmp_path,
        "--redis-url",
        "redis+sentinel://h:1",
        says="a Sentinel URL names the service",
    )


def test_an_unreachable_redis_fails_the_start_in_one_line(tiny_model_dir, tmp_path):
    url = f"redis://user:hunter2@127.0.0.1:{free_port()}/0"
    _fails_with_one_line(tiny_model_dir, tmp_path, "--redis-url", url, says="does not answer")
    proc = _serve(tiny_model_dir, tmp_path, "--port", str(free_port()), "--redis-url", url)
    assert "hunter2" not in proc.communicate(timeout=120)[1]  # the password is never shown


def test_a_second_server_on_the_same_data_dir_fails_at_once(tiny_model_dir, tmp_path):
    port = free_port()
    first = _serve(tiny_model_dir, tmp_path, "--port", str(port))
    try:
        _ready(f"http://127.0.0.1:{port}", first)
        _fails_with_one_line(tiny_model_dir, tmp_path, says=f"another recur server (pid {first.pid})")
        assert httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200  # the first serves on
    finally:
        os.killpg(first.pid, signal.SIGTERM)
        first.wait(timeout=60)
    # and once the first has stopped, the directory is free again
    port = free_port()
    again = _serve(tiny_model_dir, tmp_path, "--port", str(port))
    try:
        _ready(f"http://127.0.0.1:{port}", again)
    finally:
        os.killpg(again.pid, signal.SIGTERM)
        again.wait(timeout=60)
