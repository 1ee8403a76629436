"""Log format: plain text when stderr is a terminal, JSON lines otherwise, unless
RECUR_LOG_FORMAT says which. Each case is a real process whose stderr is a real pseudo-
terminal or a real pipe, configured from the environment as `recur serve` does."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import pytest

from tests.conftest import ROOT

# what `recur serve` does with its settings, then one line logged inside a request
LOG_ONE_LINE = """
import logging
from app import logs
from app.config import Settings

settings = Settings()
logs.configure(settings.log_level, settings.log_format)
logs.request_id.set("req-1")
logs.session_id.set("sess-2")
logging.getLogger("recur.test").info("hello %s", "there", extra={"status": 201})
"""


def _stderr_of(terminal: bool, log_format: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RECUR_")}
    env["PYTHONPATH"] = str(ROOT)
    if log_format is not None:
        env["RECUR_LOG_FORMAT"] = log_format
    args = [sys.executable, "-c", LOG_ONE_LINE]
    if not terminal:
        r = subprocess.run(args, env=env, stderr=subprocess.PIPE, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stderr
    primary, secondary = pty.openpty()
    try:
        proc = subprocess.Popen(args, env=env, stderr=secondary)
        os.close(secondary)  # the child holds the only copy: reading ends when it exits
        chunks = []
        while True:
            try:
                chunk = os.read(primary, 4096)
            except OSError:  # EIO: the terminal's other end is closed
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert proc.wait(timeout=60) == 0
    finally:
        os.close(primary)
    return b"".join(chunks).decode().replace("\r\n", "\n")  # a terminal writes \n as \r\n


def _is_text(out: str) -> None:
    line = out.strip()
    assert not line.startswith("{"), line
    assert "INFO" in line and "recur.test: hello there" in line
    assert line.endswith("request_id=req-1 session_id=sess-2")


def _is_json(out: str) -> None:
    record = json.loads(out.strip())
    assert (record["level"], record["logger"], record["message"]) == ("info", "recur.test", "hello there")
    assert (record["request_id"], record["session_id"], record["status"]) == ("req-1", "sess-2", 201)


@pytest.mark.parametrize(
    "terminal, log_format, check",
    [
        (True, None, _is_text),  # a person at a terminal
        (False, None, _is_json),  # a pipe: a log collector
        (True, "json", _is_json),
        (False, "text", _is_text),
        (True, "auto", _is_text),
        (False, "auto", _is_json),
    ],
)
def test_log_format_follows_the_terminal_unless_set(terminal, log_format, check):
    check(_stderr_of(terminal, log_format))
