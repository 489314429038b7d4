"""omlx/cache stays in the shape issue #30 gave it: small modules and functions, contracts in
docstrings, measurements in docs/design, broad excepts only where a thread would die."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

CACHE = sorted((Path(__file__).resolve().parents[2] / "omlx" / "cache").rglob("*.py"))


@pytest.mark.parametrize("path", CACHE, ids=lambda p: "/".join(p.parts[p.parts.index("cache") + 1 :]))
def test_modules_and_functions_stay_small(path: Path) -> None:
    text = path.read_text()
    assert len(text.splitlines()) <= 500
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno - node.lineno + 1 <= 60, node.name


@pytest.mark.parametrize("path", CACHE, ids=lambda p: "/".join(p.parts[p.parts.index("cache") + 1 :]))
def test_docstrings_state_contracts_in_three_lines_at_most(path: Path) -> None:
    tree = ast.parse(path.read_text())
    for node in [tree, *ast.walk(tree)]:
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            assert doc is None or len(doc.splitlines()) <= 3, getattr(node, "name", path.name)


@pytest.mark.parametrize("path", CACHE, ids=lambda p: "/".join(p.parts[p.parts.index("cache") + 1 :]))
def test_no_machine_names_dates_or_sessions(path: Path) -> None:
    text = path.read_text()
    assert not re.search(r"H200|H100|\b20\d\d-\d\d|\bsession \d", text)


@pytest.mark.parametrize("path", CACHE, ids=lambda p: "/".join(p.parts[p.parts.index("cache") + 1 :]))
def test_broad_excepts_only_at_a_thread_s_boundary(path: Path) -> None:
    for line in path.read_text().splitlines():
        if re.search(r"except (Exception|BaseException)\b", line):
            assert "BLE001" in line and ("thread" in line or "scan" in line or "belt and braces" in line), line
