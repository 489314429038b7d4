"""Build the process-wide cache tiers (`Tiers`) from settings (sizes may be shares of RAM or disk)."""

from __future__ import annotations

import shutil

import psutil

from omlx.cache.sizes import parse_size
from omlx.cache.tiers.demotion import DEMOTE_BOUND_GPU
from omlx.cache.tiers.tiers import Tiers
from omlx.errors import ConfigError
from omlx.platform_info import discrete_gpu, gpu_memory_bytes
from omlx.settings import Settings


def hot_tier_total_bytes() -> int:
    """What a `%` hot budget is a share of: the GPU's memory (device memory on CUDA, unified
    memory on Apple silicon), else RAM."""
    return gpu_memory_bytes() or psutil.virtual_memory().total


def ram_tier_bytes(setting: str) -> int:
    """`--ram-cache-max-size` in bytes; `auto` is 20% of RAM on a discrete GPU, else off."""
    if setting == "auto":
        setting = "20%" if discrete_gpu() else "0"
    try:
        return parse_size(setting, total=psutil.virtual_memory().total)
    except ValueError as exc:
        raise ConfigError(f"Invalid value for ram_cache_max_size: {exc}") from None


def count_ram_tier_in_mlx_limit(ram_bytes: int) -> None:
    """Raise MLX's memory limit by the RAM tier's budget: MLX counts the tier's staged arrays as
    its own, and past its limit (on CUDA, 80% of the GPU's memory) it empties its buffer cache at
    every allocation."""
    import mlx.core as mx

    global _ram_tier_in_limit
    mx.set_memory_limit(mx.get_memory_limit() - _ram_tier_in_limit + ram_bytes)
    _ram_tier_in_limit = ram_bytes  # a second set of tiers (tests) replaces the first's share


_ram_tier_in_limit = 0


def build_cache_store(settings: Settings) -> Tiers | None:
    """The tiers every model of the server shares; None when the cache is off (`--no-cache`)."""
    if settings.no_cache:
        return None
    try:
        hot_bytes = parse_size(settings.hot_cache_max_size, total=hot_tier_total_bytes())
    except ValueError as exc:
        raise ConfigError(f"Invalid value for hot_cache_max_size: {exc}") from None
    ram_bytes = ram_tier_bytes(settings.ram_cache_max_size)
    if ram_bytes:
        count_ram_tier_in_mlx_limit(ram_bytes)
    cache_dir, ssd_bytes = None, 0
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
    # on a discrete GPU, blocks let go may wait in device memory for their RAM copy: as many bytes
    # as the hot tier holds (1 GiB at least); memory admission counts them, and what it asks the
    # hot tier to yield is copied out first (docs/design/ram-moves.md)
    demote_bound = max(DEMOTE_BOUND_GPU, hot_bytes) if discrete_gpu() else 0
    return Tiers(
        settings.cache_block_size, hot_bytes, ram_bytes=ram_bytes, ssd_folder=cache_dir, ssd_bytes=ssd_bytes,
        demote_bound=demote_bound,
    )  # fmt: skip
