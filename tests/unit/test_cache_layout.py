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


SHAPE = ("plan", "loader", "saver", "tiers", "block")


def test_the_folder_shows_the_shape() -> None:
    # the plan, the loader, the saver, the tiers (device, RAM, SSD with its format, index and reads)
    # and the block (format, hashing, kinds) are groups a reader sees at once
    root = CACHE[0].parents[0] if CACHE[0].parent.name == "cache" else CACHE[0].parents[1]
    folders = {p.name for p in root.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(SHAPE), folders
    assert {p.name for p in (root / "tiers" / "ssd").glob("*.py")} >= {"tier.py", "format.py", "index.py", "reads.py"}
    assert {p.name for p in (root / "block").glob("*.py")} >= {"block.py", "hashing.py", "kinds.py"}
    loose = {p.name for p in root.glob("*.py")}
    assert loose <= {"__init__.py", "interface.py", "prefix_cache.py", "setup.py", "sizes.py", "store.py", "model_shapes.py"}, loose


def declared(cls: ast.ClassDef) -> set[str]:
    """The names a class declares: its methods, class attributes and fields, and what its methods assign to `self`."""
    names: set[str] = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return names


@pytest.mark.parametrize("path", CACHE, ids=lambda p: "/".join(p.parts[p.parts.index("cache") + 1 :]))
def test_no_mixins_and_no_self_name_a_class_does_not_declare(path: Path) -> None:
    # the reshape's point (issue #46): a class is read alone; what it uses of itself it declares
    tree = ast.parse(path.read_text())
    classes = [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    for cls in classes:
        bases = [ast.unparse(b) for b in cls.bases]
        assert len(bases) <= 1, (cls.name, bases)  # no mixins
        if bases and bases[0] not in ("Protocol", "Exception"):
            continue  # an enum or a named tuple: its names come from its base
        names = declared(cls)
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
                assert node.attr in names, f"{cls.name} reads self.{node.attr}, which it does not declare"


@pytest.mark.parametrize("path", CACHE, ids=lambda p: "/".join(p.parts[p.parts.index("cache") + 1 :]))
def test_locks_are_made_by_their_owner_and_never_swapped_in(path: Path) -> None:
    # a lock is set once, as its holder is made (given, or created there); never assigned later
    tree = ast.parse(path.read_text())
    for fn in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name != "__init__"]:
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    assert not (isinstance(t, ast.Attribute) and t.attr.lstrip("_") == "lock"), (fn.name, ast.unparse(node))


@pytest.mark.parametrize("path", CACHE, ids=lambda p: "/".join(p.parts[p.parts.index("cache") + 1 :]))
def test_no_cache_code_branches_on_which_thread_runs_it(path: Path) -> None:
    # which thread may call what is written down (docs/design/cache-threads.md), never tested at run time;
    # the SSD writer lowers its own priority by its native id, which is no branch
    text = path.read_text()
    found = re.findall(r"threading\.(get_ident|current_thread|main_thread)\(", text)
    assert not found, found
