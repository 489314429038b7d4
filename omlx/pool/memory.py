"""Model memory: estimated before loading (from safetensors headers), measured after.

The estimate accounts for the compute dtype: a 4-bit model dequantized to float32 on
a CPU takes ~8x its file size. Measurement uses MLX's active-memory counter, which
works on CPU, CUDA and Metal alike.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import psutil

from omlx.models.discovery import ModelInfo

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2,
               "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
TARGET_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# The safetensors format caps its JSON header at 100 MB.
MAX_HEADER_BYTES = 100 * 1024 * 1024


def _headers(path: Path) -> dict:
    """A safetensors file's header; ValueError for a file that is not one (its first 8 bytes
    would otherwise ask to read any length)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(MAX_HEADER_BYTES, path.stat().st_size - 8):
            raise ValueError(f"{path.name} is not a safetensors file (header length {n})")
        header = json.loads(f.read(n))
    if not isinstance(header, dict) or not all(
        isinstance(meta, dict) and isinstance(meta.get("shape"), list) and isinstance(meta.get("dtype"), str)
        for name, meta in header.items()
        if name != "__metadata__"
    ):
        raise ValueError(f"{path.name} is not a safetensors file (its header is not one)")
    return header


def estimate_model_bytes(info: ModelInfo, compute_dtype: str) -> int:
    """Bytes the weights will take once loaded in `compute_dtype` ("native" keeps file dtypes)."""
    quant = info.config.get("quantization") or info.config.get("quantization_config") or {}
    bits = quant.get("bits") if isinstance(quant, dict) else None
    target = TARGET_BYTES.get(compute_dtype)
    total = 0
    for file in sorted(info.path.glob("*.safetensors")):
        try:
            header = _headers(file)
        except (OSError, ValueError, struct.error):
            total += file.stat().st_size
            continue
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            numel = 1
            for d in meta["shape"]:
                numel *= d
            size = DTYPE_BYTES.get(meta["dtype"], 4)
            if target is None:
                total += numel * size
            elif bits and name.endswith((".scales", ".biases")) and meta["dtype"] != "F32":
                continue  # folded into the dequantized weight
            elif bits and meta["dtype"] == "U32":
                total += numel * (32 // bits) * target
            elif meta["dtype"] in ("F32", "F16", "BF16"):
                total += numel * target
            else:
                total += numel * size
    return total


def memory_limit_total() -> int:
    """What a `%` memory limit is a share of: device memory on a discrete GPU, else RAM."""
    from omlx.cache.setup import hot_tier_total_bytes

    return hot_tier_total_bytes()


T = TypeVar("T")


def load_measured(loader: Callable[[], T]) -> tuple[T, int]:
    """Run a model loader (on the engine's thread) and return what it built with the memory it
    took, measured by MLX's active-memory counter rather than estimated."""
    import mlx.core as mx

    before = mx.get_active_memory()
    loaded = loader()
    return loaded, max(0, mx.get_active_memory() - before)


def process_rss() -> int:
    return psutil.Process().memory_info().rss
