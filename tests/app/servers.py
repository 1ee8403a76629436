"""A test module's own `recur serve`: the one place that says how a module's fixture starts
its server (a fresh work folder, 1 torch thread unless it says otherwise) and stops it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ServerProcess


def serve(
    model: str | Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory, **settings: object
) -> Iterator[ServerProcess]:
    """A server of `model` (a shipped name, a checkpoint folder or a GGUF file) with
    `settings` as its recur serve flags, for a fixture to `yield from`: stopped when the
    fixture ends."""
    flags = {"cpu_threads": 1, **settings}
    with ServerProcess(model, tmp_path_factory.mktemp("server"), redis_url, **flags) as srv:
        yield srv
