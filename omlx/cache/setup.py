"""Build the process-wide cache tiers from settings (sizes may be shares of RAM or disk)."""

from __future__ import annotations

import shutil

import psutil

from omlx.cache.hot_tier import HotTier
from omlx.cache.sizes import parse_size
from omlx.cache.ssd_tier import SSDTier
from omlx.cache.store import CacheStore
from omlx.cache.write_back import DEMOTE_BOUND_GPU
from omlx.errors import ConfigError
from omlx.platform_info import discrete_gpu, gpu_memory_bytes
from omlx.settings import Settings


def hot_tier_total_bytes() -> int:
    """What a `%` hot budget is a share of: the GPU's memory (device memory on CUDA, unified
    memory on Apple silicon), else RAM."""
    return gpu_memory_bytes() or psutil.virtual_memory().total


def warm_tier_bytes(setting: str) -> int:
    """`--ram-cache-max-size` in bytes; `auto` is 20% of RAM on a discrete GPU, else off."""
    if setting == "auto":
        setting = "20%" if discrete_gpu() else "0"
    try:
        return parse_size(setting, total=psutil.virtual_memory().total)
    except ValueError as exc:
        raise ConfigError(f"Invalid value for ram_cache_max_size: {exc}") from None


def count_ram_tier_in_mlx_limit(warm_bytes: int) -> None:
    """Raise MLX's memory limit by the RAM tier's budget: MLX counts the tier's staged arrays as
    its own, and past its limit (on CUDA, 80% of the GPU's memory) it empties its buffer cache at
    every allocation."""
    import mlx.core as mx

    global _ram_tier_in_limit
    mx.set_memory_limit(mx.get_memory_limit() - _ram_tier_in_limit + warm_bytes)
    _ram_tier_in_limit = warm_bytes  # a second store (tests) replaces the first's share


_ram_tier_in_limit = 0


def build_cache_store(settings: Settings) -> CacheStore | None:
    """None when the cache is off (`--no-cache`)."""
    if settings.no_cache:
        return None
    try:
        hot_bytes = parse_size(settings.hot_cache_max_size, total=hot_tier_total_bytes())
    except ValueError as exc:
        raise ConfigError(f"Invalid value for hot_cache_max_size: {exc}") from None
    warm = HotTier(warm_tier_bytes(settings.ram_cache_max_size))
    if warm.enabled:
        count_ram_tier_in_mlx_limit(warm.max_bytes)
    ssd = None
    if not settings.hot_cache_only:
        cache_dir = settings.cache_dir
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"Cache dir {cache_dir} is not usable ({exc.strerror}). Pass --cache-dir.") from None
        try:
            ssd_bytes = parse_size(settings.ssd_cache_max_size, total=shutil.disk_usage(cache_dir).total)
        except ValueError as exc:
            raise ConfigError(f"Invalid value for ssd_cache_max_size: {exc}") from None
        ssd = SSDTier(cache_dir, ssd_bytes)
    # on a discrete GPU, evicted blocks may wait in device memory for their RAM copy: as many
    # bytes as the hot tier holds (1 GiB at least); memory admission counts them, and what it
    # asks the hot tier to yield is copied out first (docs/design/ram-moves.md)
    demote_bound = max(DEMOTE_BOUND_GPU, hot_bytes) if discrete_gpu() else 0
    return CacheStore(HotTier(hot_bytes), ssd, settings.cache_block_size, warm=warm, demote_bound=demote_bound)
