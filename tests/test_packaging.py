"""The wheel holds every file app/ and model/ read at run time.

The image installs recur as a wheel, not in editable mode, so a file that the checkout has and
the wheel lacks (the Lua scripts of app/store/lua/ once) passes every test run from the
checkout and fails the container at startup. This builds the wheel the way the Dockerfile does
and compares it with what git tracks."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _checked_in(*paths: str) -> list[str]:
    """The files git has or would add (tracked, or untracked and not ignored) under paths."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", *paths],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: cannot tell which files app/ and model/ hold")
    return [line for line in out.splitlines() if line and (ROOT / line).is_file()]


def test_the_wheel_holds_every_file_of_app_and_model(tmp_path: Path) -> None:
    # built from a copy: setuptools reuses a build/ directory left in the tree, which can hold
    # files pyproject.toml no longer packs (and would leave one behind in the checkout)
    source, out = tmp_path / "source", tmp_path / "wheel"
    files = _checked_in("app", "model")
    for name in [*files, "pyproject.toml", "README.md"]:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / name, source / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(source),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    (wheel,) = out.glob("recur-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        packed = set(archive.namelist())
    missing = sorted(set(files) - packed)
    assert not missing, (
        "files the checkout has and the wheel (so the image) lacks; add them to "
        "[tool.setuptools.package-data] in pyproject.toml:\n  " + "\n  ".join(missing)
    )
