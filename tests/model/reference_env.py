"""The isolated reference environments that parity tests run HF transformers in.

Two of them, kept apart from the main environment and from each other, each installed
with `pip install --target` (`make ref-env`, which `make test` depends on) and put on the
path of a reference subprocess only; torch comes from the main environment:

- `.venv-ref/`: transformers 4.37.2, the last release whose Transformer-XL runs, with its
  numpy<2 world (reference-requirements.txt);
- `.venv-ref-current/`: a current transformers with the `gguf` reader, for the families
  that only current releases implement (Mamba, Mamba-2, GGUF LLaMA loading;
  reference-current-requirements.txt).

A test asks for one with `run_reference(env, script, *args)`; it skips loudly only when the
environment is absent and cannot be built.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).parent


@dataclass(frozen=True)
class ReferenceEnv:
    path: Path
    requirements: Path
    no_deps: Path | None = None  # then these, without their dependencies (torch: the main env's)

    def ensure(self) -> None:
        """Build the environment if it is missing (as `make ref-env` would); under a lock, so
        that two pytest-xdist workers never install into one directory at once."""
        if (self.path / ".installed").is_file():
            return
        with open(self.path.with_name(self.path.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if (self.path / ".installed").is_file():  # the other worker built it meanwhile
                return
            pip = [sys.executable, "-m", "pip", "install", "-q", "--upgrade", "--target", str(self.path)]
            steps = [[*pip, "-r", str(self.requirements)]]
            if self.no_deps is not None:
                steps.append([*pip, "--no-deps", "-r", str(self.no_deps)])
            for cmd in steps:
                self._install(cmd)
            (self.path / ".installed").touch()

    def _install(self, cmd: list[str]) -> None:
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            pytest.skip(
                f"REFERENCE ENV MISSING: {self.path} is absent and `{' '.join(cmd)}` failed ({e}); run `make ref-env`"
            )
        if res.returncode != 0:
            pytest.skip(
                f"REFERENCE ENV MISSING: {self.path} is absent and could not be built "
                f"(`{' '.join(cmd)}` exited {res.returncode}: {res.stderr.strip()[-500:]}); run `make ref-env`"
            )

    def run(self, script: Path, *args: str | Path, home: Path, timeout: float = 300) -> str:
        """Run `script` with this environment first on the path, offline; its stdout."""
        self.ensure()
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(self.path), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(home),
            "PYTHONWARNINGS": "ignore",
        }
        res = subprocess.run(
            [sys.executable, str(script), *map(str, args)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert res.returncode == 0, f"reference subprocess {script.name} failed:\n{res.stderr[-3000:]}"
        return res.stdout


LEGACY = ReferenceEnv(ROOT / ".venv-ref", HERE / "reference-requirements.txt")
CURRENT = ReferenceEnv(
    ROOT / ".venv-ref-current",
    HERE / "reference-current-requirements.txt",
    HERE / "reference-current-nodeps.txt",
)
