"""Fixtures of the fault tests: every test that touches state runs once per model family.

`family` is package-scoped, so pytest runs every fault test of one family, then every one
of the other, and the servers a family's tests share start once per family.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import model
from tests.conftest import ServerProcess

from .harness import FAMILIES, DurableRedis, durable_server, make_models


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_models(tmp_path_factory.mktemp("fault-models"))


@pytest.fixture(scope="package", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="package")
def model_dir(family: str, family_dirs: dict[str, Path]) -> Path:
    return family_dirs[family]


@pytest.fixture(scope="package")
def lm(model_dir: Path) -> model.LanguageModel:
    """The served model, loaded in the test process, to check stored states against."""
    return model.load(model_dir, device="cpu")


@pytest.fixture(scope="package")
def durable(
    model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[DurableRedis, ServerProcess]]:
    """A redis-server with an fsync-always AOF, and one server on it (the crash and
    Redis-failure tests share it)."""
    with durable_server(model_dir, tmp_path_factory.mktemp("durable")) as both:
        yield both


@pytest.fixture
def durable_up(durable: tuple[DurableRedis, ServerProcess]) -> tuple[DurableRedis, ServerProcess]:
    """`durable`, running (a test that failed half-way may have left either one down)."""
    red, srv = durable
    if red.proc is None or red.proc.poll() is not None:
        red.start()
    if srv.proc is None or srv.proc.poll() is not None:
        srv.start()
    return red, srv
