"""Fixtures of the fault tests: every test that touches state runs once per model family."""

from __future__ import annotations

from pathlib import Path

import pytest

import model

from .harness import FAMILIES, make_models


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_models(tmp_path_factory.mktemp("fault-models"))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def model_dir(family: str, family_dirs: dict[str, Path]) -> Path:
    return family_dirs[family]


@pytest.fixture(scope="module")
def lm(model_dir: Path) -> model.LanguageModel:
    """The served model, loaded in the test process, to check stored states against."""
    return model.load(model_dir, device="cpu")
