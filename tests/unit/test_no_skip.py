"""OMLX_TESTS_NO_SKIP=1 (CI) turns a skip into a failure, except where a test may skip."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CONFTEST = "from tests.support.no_skip import *  # noqa: F403\n"
TESTS = '''
import pytest

def test_runs():
    pass

def test_skips_in_its_body():
    pytest.skip("no widget here")

@pytest.mark.skipif(True, reason="condition says no")
def test_skipped_by_a_marker():
    pass

@pytest.mark.allowed_skip(reason="needs hardware CI lacks")
def test_may_skip():
    pytest.skip("no hardware")

@pytest.mark.xfail(strict=True, reason="a known bug")
def test_known_bug():
    assert False
'''
MODULE_SKIP = 'import pytest\npytest.skip("whole module", allow_module_level=True)\n'


def run(tmp_path: Path, enforced: bool, module_skip: bool = False) -> tuple[int, str]:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_cases.py").write_text(TESTS)
    if module_skip:
        (tmp_path / "test_module_skip.py").write_text(MODULE_SKIP)
    env = {k: v for k, v in os.environ.items() if k != "OMLX_TESTS_NO_SKIP"}
    env["PYTHONPATH"] = str(ROOT)
    if enforced:
        env["OMLX_TESTS_NO_SKIP"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def summary(output: str) -> str:
    return re.findall(r"^=*\s*(\d+ \w+.*) in [\d.]+s", output, re.M)[-1]


def test_without_the_variable_skips_are_skips(tmp_path: Path) -> None:
    """Locally (no OMLX_TESTS_NO_SKIP) a skip stays a skip, its reason printed by -rs."""
    code, out = run(tmp_path, enforced=False)
    assert code == 0, out
    assert summary(out) == "1 passed, 3 skipped, 1 xfailed"
    assert "no widget here" in out and "condition says no" in out


def test_with_the_variable_a_skip_fails_unless_the_test_may_skip(tmp_path: Path) -> None:
    """With OMLX_TESTS_NO_SKIP=1 a skip fails and names its reason (in the test's body: a
    failure; by a marker, at setup: an error); an `allowed_skip` test still skips and an
    xfail stays an xfail."""
    code, out = run(tmp_path, enforced=True)
    assert code == 1, out
    assert summary(out) == "1 failed, 1 passed, 1 skipped, 1 xfailed, 1 error"
    must_run = "skipped, but OMLX_TESTS_NO_SKIP=1 says this test must run here"
    assert re.search(rf"_ test_skips_in_its_body _+\n{must_run}: no widget here\n", out), out
    assert re.search(rf"_ ERROR at setup of test_skipped_by_a_marker _+\n{must_run}: condition says no\n", out), out
    assert "FAILED test_cases.py::test_skips_in_its_body" in out
    assert "ERROR test_cases.py::test_skipped_by_a_marker" in out


@pytest.mark.parametrize("enforced", [False, True])
def test_a_module_skipped_at_collection_fails_the_run_only_with_the_variable(tmp_path: Path, enforced: bool) -> None:
    """A module skipped at collection has no test to fail: the run's exit status does."""
    code, out = run(tmp_path, enforced=enforced, module_skip=True)
    if enforced:
        assert code == 1 and "a module skipped at collection" in out and "whole module" in out, out
    else:
        assert code == 0, out


def test_gpu_tests_may_skip(pytestconfig: pytest.Config) -> None:
    """Every test under tests/gpu carries `allowed_skip` (CI is a CPU machine): the hook marks
    them by their folder, so a new GPU test needs no marker of its own."""
    from tests.support.no_skip import GPU_DIR, pytest_collection_modifyitems

    class Item:
        def __init__(self, path: Path) -> None:
            self.path = path
            self.markers: list[pytest.Mark] = []

        def add_marker(self, mark: pytest.MarkDecorator) -> None:
            self.markers.append(mark.mark)

    gpu, other = Item(GPU_DIR / "test_x.py"), Item(ROOT / "tests" / "unit" / "test_x.py")
    pytest_collection_modifyitems([gpu, other])  # type: ignore[list-item]
    assert [m.name for m in gpu.markers] == ["allowed_skip"] and other.markers == []


def test_a_test_that_clears_the_variable_still_fails_its_skip(tmp_path: Path) -> None:
    """The variable is read at start: a test whose fixture clears OMLX_* variables (as
    `omlx_home` does) cannot make its own skip pass."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_clears.py").write_text(
        "import os, pytest\n\ndef test_clears(monkeypatch):\n"
        "    monkeypatch.delenv('OMLX_TESTS_NO_SKIP')\n    pytest.skip('cleared')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMLX_TESTS_NO_SKIP": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1 and summary(done.stdout) == "1 failed", done.stdout
