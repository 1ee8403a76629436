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
import pytest
import redis

import model
from model.chat_template import ChatTemplate, play_script
from tests.app.sse_client import events
from tests.conftest import ROOT, TINY, RedisProcess, free_port


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECUR_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONFAULTHANDLER"] = "1"  # (`_stopped`: a server that never stops shows its threads)
    return env


def _reading(proc: subprocess.Popen, lines: list[str]) -> None:
    """Collect the server's stderr into `lines` as it comes, in a thread of its own."""
    threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")), daemon=True).start()  # type: ignore[union-attr]


def _stopped(proc: subprocess.Popen, stderr: list[str], timeout: float = 60) -> int:
    """The server's exit code once it has stopped. One still running `timeout` seconds
    later (its stop is bounded at well under that: docs/OPERATIONS.md) is made to print
    every thread's stack (faulthandler, on SIGABRT), and the test fails with them."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        proc.wait(timeout=30)
        time.sleep(0.5)  # (the reader thread's last lines)
        pytest.fail(
            f"the server had not stopped {timeout:.0f} s after the signal:\n" + "".join(stderr)[-30_000:]
        )


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
        _reading(proc, stderr)
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
        assert _stopped(proc, stderr) == 0
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


def _chat_model(path: Path) -> Path:
    """A tiny byte-level model with the play-script template, whose turn stop is text that
    random weights never write (a blank line comes after 68-674 tokens, seeds 0-5: too soon
    for a stream that must still be live when Ctrl-C lands on a loaded machine); the
    requests set `ignore_eos`, since a sampled EOS would end them as soon."""
    template = ChatTemplate(play_script().source, ("\x00\x01 end of turn \x01\x00",))
    model.init(path, seed=0, chat_template=template, **TINY)
    return path


def test_ctrl_c_ends_live_responses_streams_with_their_final_events(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    chat = _chat_model(tmp_path / "model")
    proc = _serve(chat, tmp_path, "--port", str(port), "--max-tokens", "200000")
    stderr: list[str] = []
    long = {"input": "Good morrow.", "max_output_tokens": 150_000, "temperature": 1, "ignore_eos": True}
    streamed: list[tuple[str, dict]] = []
    replayed: list[tuple[str, dict]] = []
    try:
        _ready(url, proc)
        _reading(proc, stderr)
        # a background response, and a replay of its events that follows it live
        bg = httpx.post(url + "/v1/responses", json={**long, "background": True, "seed": 1}).json()

        def replay() -> None:
            params = {"stream": "true"}
            with httpx.stream("GET", f"{url}/v1/responses/{bg['id']}", params=params, timeout=60) as r:
                replayed.extend(events(r))

        follower = threading.Thread(target=replay, daemon=True)
        follower.start()
        with httpx.stream(
            "POST", url + "/v1/responses", json={**long, "stream": True, "seed": 0}, timeout=60
        ) as r:
            for name, data in events(r):
                streamed.append((name, data))
                if len(streamed) == 24:  # both live: Ctrl-C, as the terminal sends it, to the group
                    os.killpg(proc.pid, signal.SIGINT)
        follower.join(timeout=60)
        assert _stopped(proc, stderr) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # the stream's last event is `response.failed`, as any failure once streaming has begun
    name, data = streamed[-1]
    assert name == "response.failed", streamed[-3:]
    error = data["response"]["error"]
    assert error["code"] == "not_ready" and "shutting down" in error["message"]
    assert [n for n, _ in streamed[4:-1]] == ["response.output_text.delta"] * (len(streamed) - 5)
    # the replay's is OpenAI's `error` event: the response itself goes on, or fails, on its own
    name, data = replayed[-1]
    assert name == "error" and data["code"] == "not_ready", replayed[-3:]
    time.sleep(0.5)  # (the reader thread's last read)
    assert "Traceback" not in "".join(stderr)
    # after a restart: both responses are kept as failed (the background one's by its worker as
    # the server stopped, with `response.failed` last among its events), Redis having outlived them
    port = free_port()
    again = _serve(chat, tmp_path, "--port", str(port))
    try:
        url = f"http://127.0.0.1:{port}"
        _ready(url, again)
        foreground = httpx.get(f"{url}/v1/responses/{streamed[-1][1]['response']['id']}").json()
        assert foreground["status"] == "failed" and foreground["error"]["code"] == "not_ready"
        background = httpx.get(f"{url}/v1/responses/{bg['id']}").json()
        assert background["status"] == "failed" and "was stopped" in background["error"]["message"]
        with httpx.stream(
            "GET", f"{url}/v1/responses/{bg['id']}", params={"stream": "true"}, timeout=60
        ) as r:
            kept = list(events(r))
        assert kept[-1][0] == "response.failed" and len(kept) > len(replayed) - 1
    finally:
        os.killpg(again.pid, signal.SIGTERM)
        again.wait(timeout=60)


def test_redis_that_dies_at_runtime_is_one_line_then_the_server_serves_again(tiny_model_dir, tmp_path):
    """Redis going away while the server runs: the background responses' sweep (every half
    lease) says so in one line, retries quietly, never prints a traceback, and says so again
    once Redis is back; the server serves again."""
    redis_dir = tmp_path / "redis"
    redis_dir.mkdir()
    redis = RedisProcess(redis_dir)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = ("--port", str(port), "--redis-url", redis.url, "--response-lease-seconds", "0.4")
    proc = _serve(tiny_model_dir, tmp_path, *flags)
    stderr: list[str] = []
    try:
        _ready(url, proc)
        _reading(proc, stderr)
        redis.proc.kill()  # as a crash would: no goodbye
        redis.proc.wait()

        def said(text: str) -> list[str]:
            return [line for line in list(stderr) if text in line]

        deadline = time.monotonic() + 60
        while not said("cannot sweep") and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # five more sweep periods, with Redis still away
        assert len(said("cannot sweep")) == 1, "".join(stderr)
        assert httpx.post(url + "/v1/sessions", json={"prompt": "abc"}).status_code == 503
        redis = RedisProcess(redis_dir, port=redis.port)  # back, on the same port
        deadline = time.monotonic() + 60
        while not said("runs again") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert said("runs again"), "".join(stderr)
        assert httpx.post(url + "/v1/sessions", json={"prompt": "abc"}).status_code == 201
        assert "Traceback" not in "".join(stderr), "".join(stderr)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        redis.stop()


def test_the_embedded_redis_keeps_the_data_dir_bounded(tiny_model_dir, tmp_path):
    """`make run`'s Redis has a maxmemory (`--data-max-mb`, noeviction): filled to it, new
    sessions are refused with 507 storage_full (the storage guard, before Redis itself
    refuses), nothing is evicted, and once there is room again they are made."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(tiny_model_dir, tmp_path, "--port", str(port), "--data-max-mb", "32")
    try:
        embedded = None
        for line in proc.stderr:  # type: ignore[union-attr]
            if "embedded redis-server at " in line:
                embedded = line.split("embedded redis-server at ")[1].split()[0].rstrip('",')
                break
        assert embedded, "the server never said where its Redis is"
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # type: ignore[union-attr]
        _ready(url, proc)
        r = redis.Redis.from_url(embedded)
        assert int(r.config_get("maxmemory")["maxmemory"]) == 32 * 1024 * 1024
        assert r.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        kept = httpx.post(url + "/v1/sessions", json={"prompt": "kept"}).json()["id"]
        # someone else's bytes, a MiB at a time, until the guard sees 90%. The guard is what says
        # when: a reading of used_memory just after a write holds its append-only buffer too,
        # which Redis then frees (filling to 92% of it once left the guard below 90% for 30 s)
        deadline, i = time.monotonic() + 60, 0
        while not httpx.get(url + "/readyz").json()["storage_full"] and time.monotonic() < deadline:
            used = int(r.info("memory")["used_memory"])
            if used < 0.95 * 32 * 1024 * 1024:
                r.set(f"filler:{i}", b"x" * (1024 * 1024))
                i += 1
            if used >= 0.85 * 32 * 1024 * 1024:
                time.sleep(0.6)  # (near the mark: the guard reads every 0.5 s)
        refused = httpx.post(url + "/v1/sessions", json={"prompt": "one more"})
        assert refused.status_code == 507 and refused.json()["error"]["type"] == "storage_full", refused.text
        assert httpx.get(f"{url}/v1/sessions/{kept}").status_code == 200  # (nothing evicted)
        r.delete(*r.keys("filler:*"))
        deadline = time.monotonic() + 30
        while httpx.get(url + "/readyz").json()["storage_full"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.post(url + "/v1/sessions", json={"prompt": "one more"}).status_code == 201
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
