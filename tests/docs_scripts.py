"""The scripts of docs/ (not a package), loaded by their paths for the tests that check what
they write into docs/ARCHITECTURE.md."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load(name: str) -> ModuleType:
    """docs/<name>.py as a module named `name`."""
    return load_file(ROOT / "docs" / f"{name}.py", name)


def load_file(path: Path, name: str) -> ModuleType:
    """The Python file at `path` as a module named `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module
