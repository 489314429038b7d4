"""Facts about the machine: MLX device, memory, and which BLAS MLX's CPU path uses.

The `mlx-cpu` wheel bundles a reference BLAS that is ~16x slower than OpenBLAS for
float32 matrix products. When a system OpenBLAS is installed we preload it
(re-exec with LD_PRELOAD before MLX is imported), and we say which is in use.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

import psutil

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
REEXEC_MARK = "OMLX_BLAS_PRELOADED"
BLAS_HINT = (
    "For ~16x faster float32 matmuls on a Linux CPU install OpenBLAS "
    "(Debian/Ubuntu: sudo apt-get install libopenblas0-pthread); oMLX preloads it automatically."
)


def find_openblas() -> str | None:
    for path in OPENBLAS_CANDIDATES:
        if Path(path).exists():
            return path
    return None


def maybe_reexec_with_openblas() -> None:
    """On Linux, restart this process once with OpenBLAS preloaded, if it is installed.

    Must run before `mlx` is imported; set OMLX_NO_BLAS_PRELOAD=1 to opt out.
    """
    if sys.platform != "linux" or os.environ.get("OMLX_NO_BLAS_PRELOAD") == "1":
        return
    if os.environ.get(REEXEC_MARK) or "openblas" in os.environ.get("LD_PRELOAD", ""):
        return
    lib = find_openblas()
    if lib is None:
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env[REEXEC_MARK] = "1"
    os.execve(sys.executable, [sys.executable, "-m", "omlx", *sys.argv[1:]], env)


def blas_in_use() -> str:
    """Which BLAS this process has mapped (Linux), judged from /proc/self/maps."""
    if sys.platform == "darwin":
        return "Accelerate"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    if "libopenblas" in maps:
        return "OpenBLAS"
    if "libmkl" in maps:
        return "MKL"
    return "reference BLAS (bundled with mlx-cpu; slow)"


def device_info() -> dict[str, Any]:
    import mlx.core as mx

    device = mx.default_device()
    info: dict[str, Any] = {"device": str(device), "type": "gpu" if device.type == mx.gpu else "cpu"}
    if device.type == mx.gpu:
        try:
            dev = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
            info.update({k: v for k, v in dev.items() if isinstance(v, (int, float, str))})
            total = _gpu_total_bytes(dev)
            if total:
                info["gpu_memory_bytes"] = total
        except Exception as exc:  # device_info differs per backend and version
            info["device_info_error"] = str(exc)
    return info


def _gpu_total_bytes(dev: dict[str, Any]) -> int | None:
    """A GPU's total memory: CUDA reports `total_memory`, Metal `memory_size`."""
    total = dev.get("total_memory") or dev.get("memory_size")
    return int(total) if total else None


def discrete_gpu() -> bool:
    """The default device is a CUDA GPU: memory of its own, so host RAM is a separate tier
    (unlike a CPU, or Apple silicon's unified memory)."""
    import mlx.core as mx

    return mx.default_device().type == mx.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()


def cpu_device() -> bool:
    """The default device is the CPU (no GPU backend in use)."""
    import mlx.core as mx

    return mx.default_device().type == mx.cpu


def gpu_memory_bytes() -> int | None:
    """Total memory of the default device when it is a GPU (device memory on CUDA,
    unified memory on Apple silicon); None on a CPU."""
    import mlx.core as mx

    if mx.default_device().type != mx.gpu:
        return None
    return _gpu_total_bytes(mx.device_info())


LINUX_BACKENDS = ("mlx-cpu", "mlx-cuda-13", "mlx-cuda-12", "mlx-cuda")


def missing_backend() -> str | None:
    """On Linux plain `mlx` has no compute library: one of the extras must bring it."""
    if sys.platform != "linux":
        return None
    from importlib.metadata import PackageNotFoundError, version

    for dist in LINUX_BACKENDS:
        try:
            version(dist)
            return None
        except PackageNotFoundError:
            continue
    return (
        "MLX has no backend installed. Install oMLX with one: "
        "pip install 'omlx[cpu]' (any CPU) or pip install 'omlx[cuda]' (NVIDIA GPU)."
    )


def cuda_backend_problem() -> str | None:
    """Why MLX runs on the CPU although its CUDA build is installed, or None.

    `mlx-cpu` and `mlx-cuda-13` both ship `mlx/lib/libmlx.so`; when both are installed
    (both extras, or a CPU install later given the CUDA extra), whichever pip unpacked last
    wins, and with pip 23 to 26 that is the CPU one.
    """
    if sys.platform != "linux":
        return None
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda"):
        try:
            cuda_version = version(dist)
        except PackageNotFoundError:
            continue
        import mlx.core as mx

        if hasattr(mx, "cuda") and mx.cuda.is_available():
            return None
        return (
            f"{dist} {cuda_version} is installed but MLX loaded its CPU library (mlx-cpu's copy of "
            f"mlx/lib/libmlx.so replaced it). To run on the GPU: "
            f"pip install --force-reinstall --no-deps {dist}=={cuda_version}"
        )
    return None


def memory_info() -> dict[str, int]:
    vm = psutil.virtual_memory()
    return {"total_bytes": vm.total, "available_bytes": vm.available}


def platform_summary() -> dict[str, Any]:
    import mlx.core as mx
    import mlx_lm

    dev = device_info()
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": sys.version.split()[0],
        "mlx": getattr(mx, "__version__", "unknown"),
        "mlx_lm": getattr(mlx_lm, "__version__", "unknown"),
        **dev,
        **memory_info(),
        "cpu_count": os.cpu_count(),
        "blas": blas_in_use() if dev["type"] == "cpu" else "n/a (GPU)",
        **({"backend_problem": problem} if (problem := cuda_backend_problem()) else {}),
    }
