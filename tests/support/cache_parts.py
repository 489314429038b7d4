"""Small helpers the cache tests share: tiers built as the server builds them, and a restore
carried out at once (match, load, cache_for), as an engine does for a request with nothing ahead."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from omlx.cache.loader.loading import Loading
from omlx.cache.tiers.tiers import Tiers


def make_tiers(
    block_size: int,
    device_bytes: int = 1 << 30,
    *,
    ram_bytes: int = 0,
    ssd: Path | None = None,
    ssd_bytes: int = 1 << 30,
    demote_bound: int = 0,
    **ssd_options: int,
) -> Tiers:
    """Tiers with an SSD under `ssd` (none if None), its index rebuilt before they are returned."""
    options = {f"ssd_{name}": value for name, value in ssd_options.items()}
    tiers = Tiers(
        block_size, device_bytes, ram_bytes=ram_bytes, ssd_folder=ssd, ssd_bytes=ssd_bytes if ssd is not None else 0,
        demote_bound=demote_bound, **options,
    )  # fmt: skip
    if tiers.ssd is not None:
        assert tiers.ssd.wait_ready(10)
    return tiers


def restore(cache: Any, tokens: list[int], grid: int = 0) -> tuple[list[Any] | None, int]:
    """What a request's insert restores when nothing was made ready ahead: plan, load, cache."""
    return cache.cache_for(cache.load(cache.match(tokens, grid)))


def read_ahead(cache: Any, tokens: list[int], on_ready: Callable[[], None] = lambda: None) -> Loading | None:
    """A request's restore started at its admission: its loading when something is made ready ahead, else None."""
    loading = cache.load(cache.match(tokens), on_ready)
    return loading if loading.pending else None
