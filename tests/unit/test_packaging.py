"""Packaging: installing oMLX prints no deprecation warning of our own making."""

from __future__ import annotations

import warnings
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_pyproject_applies_without_setuptools_warnings(monkeypatch):
    monkeypatch.chdir(PYPROJECT.parent)  # the readme and package paths are relative to it
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        apply_configuration(Distribution(), str(PYPROJECT))
    assert [str(w.message).splitlines()[0] for w in seen] == []
