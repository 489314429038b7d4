"""Shared fixtures: a tiny random-weight model, temporary OMLX_HOME, a real server subprocess."""

from __future__ import annotations

import gc
import os
import shutil
from pathlib import Path

import pytest

from tests.support.no_skip import (  # noqa: F401 - hooks: CI's skips fail (OMLX_TESTS_NO_SKIP=1)
    pytest_collection_modifyitems,
    pytest_collectreport,
    pytest_configure,
    pytest_runtest_makereport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)
from tests.support.server import ServerProcess
from tests.support.tiny_model import build_tiny_llama


@pytest.fixture(autouse=True)
def _unfrozen_heap():
    """A model loaded in-process freezes the heap (`engine_pool.freeze_heap`), this test
    process's included: thawed after each test, so no test's garbage outlives it."""
    yield
    gc.unfreeze()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model dir holding one tiny random Llama, `tiny-llama`."""
    root = tmp_path_factory.mktemp("models")
    build_tiny_llama(root / "tiny-llama")
    return root


@pytest.fixture()
def omlx_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "omlx-home"
    home.mkdir()
    monkeypatch.setenv("OMLX_HOME", str(home))
    for key in list(os.environ):
        if key.startswith("OMLX_") and key != "OMLX_HOME":
            monkeypatch.delenv(key)
    return home


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A real `omlx serve` on the tiny model, shared by a test module."""
    home = tmp_path_factory.mktemp("home")
    server = ServerProcess(home, ["--model-dir", str(tiny_model_dir), "--model", "tiny-llama"])
    server.start()
    yield server
    server.stop()
    shutil.rmtree(home, ignore_errors=True)
