"""When the engine hands MLX's buffer cache back.

MLX keeps freed buffers for reuse; emptying the cache (`mx.clear_cache`) is slow on a CUDA
GPU, where mlx-lm's prefill does it after every chunk, so there the engine prefills newcomers
itself (`EngineConfig.own_prefill`). The engine's own prefills trim the cache only when it
holds a lot (a long prompt's KV cache grows by concatenation, and every outgrown buffer stays
cached), and an engine that falls idle empties it; on CUDA an idle engine also empties what
other threads freed into it (`EngineConfig.idle_empties_cache`): buffers the host has read
are managed memory, which the cache would otherwise hand to the next prefill
(docs/design/prefill-grid.md).
"""

from __future__ import annotations

import functools

import mlx.core as mx

TRIM_FRACTION = 0.05  # of the device's memory (host RAM on a CPU)
TRIM_MIN_BYTES = 512 * 1024 * 1024


@functools.cache
def trim_threshold() -> int:
    """Bytes of cached buffers above which a prefill chunk empties the cache."""
    from omlx.cache.setup import hot_tier_total_bytes  # the device's memory, else RAM

    return max(TRIM_MIN_BYTES, int(hot_tier_total_bytes() * TRIM_FRACTION))


def trim_buffer_cache() -> None:
    """Empty MLX's buffer cache if it holds more than `trim_threshold()` bytes."""
    if mx.get_cache_memory() > trim_threshold():
        mx.clear_cache()
