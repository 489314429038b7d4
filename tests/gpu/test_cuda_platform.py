"""On MLX's CUDA backend: the GPU is the default device, diagnose shows it and its memory,
and memory shares (hot cache, --max-model-memory) are shares of device memory.

Skipped unless MLX's CUDA backend is installed and sees a GPU (run them on the GPU machine:
benchmarks/gpu/README.md says how).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

mx = pytest.importorskip("mlx.core")

pytestmark = pytest.mark.skipif(
    not (hasattr(mx, "cuda") and mx.cuda.is_available()), reason="needs MLX's CUDA backend and a GPU"
)


def test_the_gpu_is_the_default_device_with_no_setting():
    assert mx.default_device().type == mx.gpu
    x = mx.arange(1024, dtype=mx.float32)
    assert (x * 2).sum().item() == 1024 * 1023


def test_device_info_names_the_gpu_and_its_memory():
    from omlx.platform_info import device_info, gpu_memory_bytes

    info = device_info()
    assert info["type"] == "gpu"
    assert info["device_name"]
    assert info["gpu_memory_bytes"] == mx.device_info()["total_memory"] > 8 << 30
    assert gpu_memory_bytes() == info["gpu_memory_bytes"]


def test_memory_shares_are_shares_of_device_memory():
    from omlx.cache.setup import hot_tier_total_bytes
    from omlx.pool.memory import memory_limit_total

    total = mx.device_info()["total_memory"]
    assert hot_tier_total_bytes() == total
    assert memory_limit_total() == total


def test_active_memory_counts_device_allocations():
    before = mx.get_active_memory()
    x = mx.zeros((64 << 20,), dtype=mx.float32)  # 256 MiB
    mx.eval(x)
    assert mx.get_active_memory() - before >= 256 << 20
    del x


def test_diagnose_shows_the_gpu(tmp_path):
    env = {**os.environ, "OMLX_HOME": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "omlx", "diagnose", "--json"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["type"] == "gpu" and info["device"].startswith("Device(gpu")
    assert info["compute_dtype"] == "native"
    assert info["gpu_memory_bytes"] > 8 << 30
