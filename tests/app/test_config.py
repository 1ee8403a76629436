"""Settings: one class, mirrored by the `recur serve` flags and documented in docs/CONFIGURATION.md."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app.cli import build_parser
from app.config import Settings
from docs.tools import config_reference
from tests.conftest import ROOT


def _serve_settings(argv: list[str]) -> Settings:
    args = build_parser().parse_args(["serve", *argv])
    return Settings(**{k: v for k, v in vars(args).items() if k in Settings.model_fields})


def test_every_setting_has_a_flag_and_an_env_var(monkeypatch):
    for name in Settings.model_fields:
        monkeypatch.delenv(f"RECUR_{name.upper()}", raising=False)
    defaults = _serve_settings([])
    assert defaults == Settings()
    monkeypatch.setenv("RECUR_MAX_TOKENS", "77")
    monkeypatch.setenv("RECUR_REDIS_URL", "redis://example:1/0")
    s = _serve_settings(["--port", "9001", "--state-dtype", "bfloat16", "--lock-lease-seconds", "2.5"])
    assert (s.max_tokens, s.redis_url, s.port, s.state_dtype, s.lock_lease_seconds) == (
        77,
        "redis://example:1/0",
        9001,
        "bfloat16",
        2.5,
    )
    assert _serve_settings(["--max-tokens", "5"]).max_tokens == 5  # a flag beats the environment
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()  # type: ignore[union-attr]
    for name in Settings.model_fields:
        assert "--" + name.replace("_", "-") in help_text


def test_bad_settings_are_refused():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--state-dtype", "int4"])
    with pytest.raises(ValueError):
        _serve_settings(["--max-tokens", "0"])


def test_the_configuration_reference_is_current():
    """docs/CONFIGURATION.md's table is generated from Settings (`make docs`)."""
    page = config_reference.PAGE.read_text()
    assert page == config_reference.current(), "docs/CONFIGURATION.md is stale: run `make docs`"
    for name in Settings.model_fields:
        assert f"`RECUR_{name.upper()}`" in page and f"`--{name.replace('_', '-')}`" in page


def test_serve_without_a_model_fails_with_a_clear_message(tmp_path: Path):
    r = subprocess.run(
        [sys.executable, "-m", "app", "--model", str(tmp_path / "missing")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 2
    assert "no checkpoint at" in r.stderr and "--model" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "data").exists()  # nothing was started
