"""`recur chat` against a real server, driven as a subprocess through its stdin and
stdout; Ctrl-C is a real SIGINT sent to its PID in the middle of a generation."""

from __future__ import annotations

import codecs
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import httpx

from tests.conftest import ROOT

# long enough that a generation is still running when the test interrupts it
SERVER_SETTINGS = {"max_tokens": 200_000}
STATUS = re.compile(r"\[session ([0-9a-f]{32}) · version (\d+) · (\d+) tokens\]")
IMPORT_LINE = re.compile(r"^import time:[^|]*\|[^|]*\| *([\w.]+)\n", re.M)


def _interruptible() -> None:
    """In the chat's process before it starts: SIGINT at its default and not blocked. A child
    inherits its parent's ignored signals and blocked-signal mask, and a test worker that
    has run other tests may hold either; Python only turns SIGINT into KeyboardInterrupt
    where it starts with the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


class ChatProcess:
    def __init__(self, url: str, *args: str):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            # `recur chat` is `python -m app.cli chat` (`python -m app.chat` is the same client:
            # tests/app/test_auth.py runs it)
            [sys.executable, "-m", "app.cli", "chat", "--url", url, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            encoding="utf-8",
            errors="replace",
            preexec_fn=_interruptible,
        )
        self.output = ""
        self._chunks: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        # whatever the pipe holds at once (a fast generation writes thousands of characters
        # a second: read one at a time, the test would fall ever further behind)
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        while chunk := os.read(fd, 65536):
            self._chunks.put(decoder.decode(chunk))

    def wait_for(self, pattern: str | re.Pattern, start: int = 0, timeout: float = 60) -> re.Match:
        rx = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while True:
            m = rx.search(self.output, start)
            if m:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"{rx.pattern!r} not seen; output so far:\n{self.output[-2000:]}")
            try:
                self.output += self._chunks.get(timeout=0.1)
                while not self._chunks.empty():  # everything that has arrived, then one search
                    self.output += self._chunks.get_nowait()
            except queue.Empty:
                if self.proc.poll() is not None and self._chunks.empty():
                    raise AssertionError(
                        f"chat exited ({self.proc.returncode}):\n{self.output[-2000:]}"
                    ) from None

    def send(self, line: str) -> int:
        """Wait for the prompt, type a line; returns where in the output the answer begins."""
        assert self.proc.stdin is not None
        mark = self.wait_for(r"\n> $", 0).end()
        assert mark == len(self.output)
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return mark

    def close(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # Ctrl-D
        return self.proc.wait(timeout=30)


def session(http: httpx.Client, sid: str) -> dict:
    r = http.get(f"/v1/sessions/{sid}")
    assert r.status_code == 200
    return r.json()


def test_chat_creates_a_session_and_streams_turns(server, http):
    chat = ChatProcess(server.url, "--max-tokens", "6", "--temperature", "0")
    try:
        sid, version, n = chat.wait_for(STATUS).groups()
        assert (version, n) == ("0", "1")
        mark = chat.send("Hello")
        m = chat.wait_for(STATUS, mark)
        assert m.group(1) == sid and m.group(2) == "1"
        s = session(http, sid)
        assert (s["version"], s["n_tokens"]) == (1, 1 + 6 + 6)  # BOS, "Hello\n", 6 tokens
        assert int(m.group(3)) == s["n_tokens"]
        # what it printed is what the session generated: the same greedy turn on a fresh session
        ref = http.post("/v1/sessions").json()["id"]
        r = http.post(
            f"/v1/sessions/{ref}/generate",
            json={"prompt": "Hello\n", "max_tokens": 6, "temperature": 0, "stream": False},
        )
        assert r.json()["text"] in chat.output[mark : m.start()]
        mark = chat.send("/info")
        assert chat.wait_for(STATUS, mark).group(2) == "1"
        assert chat.close() == 0
    finally:
        chat.proc.kill()


def test_ctrl_c_cancels_the_generation_and_keeps_the_version(server, http):
    sid = http.post("/v1/sessions", json={"prompt": "abc"}).json()["id"]
    chat = ChatProcess(server.url, sid, "--max-tokens", "150000", "--temperature", "0")
    try:
        m = chat.wait_for(STATUS)
        assert m.groups() == (sid, "0", "4")
        mark = chat.send("go on")
        # tokens are arriving (greedy: this model never ends this text by itself)
        chat.wait_for(re.compile(r"(?s).{100}"), mark)
        assert STATUS.search(chat.output, mark) is None  # the generation is still running
        os.kill(chat.proc.pid, signal.SIGINT)
        chat.wait_for(r"\[cancelled; nothing committed, session stays at version 0\]", mark)
        assert chat.proc.poll() is None  # back at the prompt, not dead
        s = session(http, sid)
        assert (s["version"], s["n_tokens"]) == (0, 4)
        # the server dropped the generation and released the lock: the next write commits
        body = {"max_tokens": 2, "stream": False, "seed": 1}
        r = http.post(f"/v1/sessions/{sid}/generate", json=body)
        deadline = time.monotonic() + 10
        while r.status_code == 409 and time.monotonic() < deadline:  # the disconnect is seen within a step
            time.sleep(0.05)
            r = http.post(f"/v1/sessions/{sid}/generate", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["session"] == {"id": sid, "version": 1, "n_tokens": 6}
        mark = chat.send("/info")
        assert chat.wait_for(STATUS, mark).groups() == (sid, "1", "6")
        assert chat.close() == 0
    finally:
        chat.proc.kill()


def test_recur_chat_with_an_unknown_session_says_so(server):
    # -X importtime lists every module the command imports (on stderr, before its own lines)
    r = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "app.cli", "chat", "--url", server.url, "0" * 32],
        capture_output=True,
        text=True,
        timeout=30,  # the guard: the client ends at the error, never waits for input or torch
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.DEVNULL,
    )
    imported = {m.group(1) for m in IMPORT_LINE.finditer(r.stderr)}
    said = IMPORT_LINE.sub("", r.stderr)
    assert r.returncode == 1, said
    assert "session_not_found" in said and "Traceback" not in said
    # a client only: torch (seconds to import, a minute on a loaded machine) and the model
    # packages never load, so `recur chat` starts and fails at once
    assert "httpx" in imported
    assert not {"torch", "model"} & imported
