"""`omlx[cuda]` can end up with MLX's CPU library (mlx-cpu and mlx-cuda-13 both ship
mlx/lib/libmlx.so); diagnose and serve then say so and name the fix. Runs on any machine."""

from __future__ import annotations

import importlib.metadata
import sys

import mlx.core as mx
import pytest

from omlx import platform_info


def _installed(*dists: str):
    def version(name: str) -> str:
        if name in dists:
            return "0.32.4"
        raise importlib.metadata.PackageNotFoundError(name)

    return version


@pytest.mark.skipif(sys.platform != "linux", reason="the wheels clash on Linux only")
def test_cuda_wheel_shadowed_by_the_cpu_library_is_reported_with_the_fix(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", _installed("mlx-cuda-13"))
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    problem = platform_info.cuda_backend_problem()
    assert problem is not None
    assert "pip install --force-reinstall --no-deps mlx-cuda-13==0.32.4" in problem


def test_no_report_when_the_cuda_build_is_loaded_or_not_installed(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", _installed("mlx-cuda-13"))
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert platform_info.cuda_backend_problem() is None
    monkeypatch.setattr(importlib.metadata, "version", _installed())
    assert platform_info.cuda_backend_problem() is None
