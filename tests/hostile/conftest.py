"""Fixtures of the hostile-input tests: one server per model family, shared by every
module here, with a small generation cap so fuzzed requests stay cheap; and one server with
API keys (`tenants`), for the attacks one tenant makes on another."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ServerProcess
from tests.faults.harness import make_models, start_all

SETTINGS = dict(cpu_threads=1, max_tokens=8, max_prompt_tokens=300, max_body_bytes=1 << 20)

# the tenants' keys: each test attacks from one key and watches another
ATTACKER, VICTIM, LEDGER = "key-attacker", "key-victim", "key-ledger"
SMALL, SLOW = "key-small", "key-slow-tokens"  # 4 sessions and 2 MiB of state; 50 tokens/s
KEYS = f"{ATTACKER}\n{VICTIM}\n{LEDGER}\n{SMALL} sessions=4 state_mb=2\n{SLOW} tokens_per_second=50\n"
# its import limit raised past the attacks' blobs, so that what they do past the size check shows
TENANT_SETTINGS = dict(cpu_threads=1, max_tokens=1000, max_prompt_tokens=300, max_import_mb=64)


@pytest.fixture(scope="session")
def hostile_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_models(tmp_path_factory.mktemp("hostile-models"))


@pytest.fixture(scope="session")
def hostile_servers(
    hostile_models: dict[str, Path], redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ServerProcess]]:
    servers = {
        name: ServerProcess(path, tmp_path_factory.mktemp(f"hostile-{name}"), redis_url, **SETTINGS)
        for name, path in hostile_models.items()
    }
    try:
        start_all(*servers.values())
        yield servers
    finally:
        for s in servers.values():
            s.stop()


@pytest.fixture(scope="session")
def tenants(
    hostile_models: dict[str, Path], redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A Transformer-XL server with API keys (`KEYS`), for the attacks between tenants."""
    keyfile = tmp_path_factory.mktemp("hostile-keys") / "keys"
    keyfile.write_text(KEYS)
    workdir = tmp_path_factory.mktemp("hostile-tenants")
    with ServerProcess(
        hostile_models["txl"], workdir, redis_url, api_keys_file=keyfile, **TENANT_SETTINGS
    ) as s:
        yield s


def as_key(server: ServerProcess, key: str, timeout: float = 60) -> httpx.Client:
    """A client of `server` that sends `key`."""
    return httpx.Client(base_url=server.url, timeout=timeout, headers={"Authorization": f"Bearer {key}"})


@pytest.fixture(scope="session")
def server(hostile_servers: dict[str, ServerProcess]) -> ServerProcess:
    """The Transformer-XL server (where the family does not matter)."""
    return hostile_servers["txl"]


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with server.client() as c:
        yield c


def assert_error(r: httpx.Response, status: int, etype: str | None = None) -> dict:
    """The response is `status` with exactly the error body `{"error": {"type", "message"}}`."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message"}, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert "Traceback" not in body["error"]["message"]
    if etype is not None:
        assert body["error"]["type"] == etype, body
    return body
