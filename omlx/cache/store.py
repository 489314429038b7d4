"""The server's name for the tiers object (omlx/server/app.py imports `CacheStore` from here)."""

from omlx.cache.tiers.tiers import Tiers as CacheStore

__all__ = ["CacheStore"]
