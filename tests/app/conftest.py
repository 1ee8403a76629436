"""Fixtures of the app tests: a real headless Chromium (Debian's chromium and chromedriver,
which .ci/run installs) and its downloads folder, for the playground page; a tiny GGUF
LLM file (BPE tokenizer, ChatML template), for the modules that serve an LLM; and a server
of each family in turn, for the modules whose routes must not know which one they serve."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.app.servers import serve
from tests.conftest import ServerProcess, tiny_model_of
from tests.model.llama_files import random_weights, write_gguf

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture(scope="module")
def downloads() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="recur-downloads-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def browser(downloads: Path):
    if not (CHROMIUM and CHROMEDRIVER):
        why = (
            "NO BROWSER: Debian's chromium and chromium-driver are not installed, so the playground "
            "is NOT tested. Install them: apt-get install -y chromium chromium-driver (.ci/run does)"
        )
        if os.environ.get("CI"):  # CI installs them: there, a missing browser is a failure
            pytest.fail(why)
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="recur-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    driver.execute_cdp_cmd(
        "Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)}
    )
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaMA GGUF file (Q8_0; `tests/model/llama_files.py`), served as a file."""
    return write_gguf(tmp_path_factory.mktemp("llm") / "tiny.gguf", random_weights(seed=3), "Q8_0")


@pytest.fixture(scope="module", params=["transformer-xl", "rlt"])
def server_of_each_family(
    request: pytest.FixtureRequest,
    tiny_model_dir: Path,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ServerProcess]:
    """A server of each family's tiny model in turn (a module that uses it runs once for
    each), on 1 torch thread; the module's `SERVER_SETTINGS` add their recur serve flags."""
    path = tiny_model_of(request.param, tiny_model_dir, tmp_path_factory)
    yield from serve(path, redis_url, tmp_path_factory, **getattr(request.module, "SERVER_SETTINGS", {}))
