"""Skips that CI must not allow: with OMLX_TESTS_NO_SKIP=1 (set by `.ci/run`) a test that
skips fails instead, unless it is marked `allowed_skip(reason=...)`.

CI runs as root on Debian with apt and the network (scripts/setup.sh installs Chromium, the
GGUF and embedding packages), so every test can run there; a skip would mean that a test
quietly stopped guarding its promise. The GPU tests (tests/gpu) are the exception: CI is a
CPU machine. xfail is not a skip and is left alone. A module skipped at collection (a
module-level `pytest.skip` or `importorskip`) fails the run at its end.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ENV = "OMLX_TESTS_NO_SKIP"
GPU_DIR = Path(__file__).resolve().parent.parent / "gpu"
GPU_REASON = "needs MLX's CUDA backend and a GPU; CI is a CPU machine"
_skipped_modules: list[str] = []
_state = {"enforced": False}


def _enforced() -> bool:
    return _state["enforced"]


def pytest_configure(config: pytest.Config) -> None:
    # read once: tests' fixtures clear OMLX_* variables (conftest's `omlx_home`) while they run
    _state["enforced"] = os.environ.get(ENV) == "1"
    config.addinivalue_line(
        "markers", f"allowed_skip(reason): this test may skip even with {ENV}=1 (it cannot run on CI's machine)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if GPU_DIR in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.allowed_skip(reason=GPU_REASON))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if not (_enforced() and report.skipped) or hasattr(report, "wasxfail"):
        return
    if item.get_closest_marker("allowed_skip") is not None:
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    report.outcome = "failed"
    report.longrepr = f"skipped, but {ENV}=1 says this test must run here: {reason}"


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if _enforced() and report.skipped:
        _skipped_modules.append(f"{report.nodeid}: {report.longrepr}")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    for line in _skipped_modules:
        terminalreporter.write_line(f"{ENV}=1: a module skipped at collection: {line}", red=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped_modules and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
