"""What an engine asks of a prefix cache (`omlx/cache/prefix_cache.py` is the one there is).

Its own module so that the cache depends on this contract, not on the engine that calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class PrefixCacheHooks:
    """What the engine asks of a prefix cache; the default caches nothing."""

    block_size = 0  # tokens per stored block (0: none)
    # the engine's prefill grid (solo.py): a restored prefix is used only up to a multiple of
    # it, so `lookup` need not fetch what the engine would drop
    grid = 0

    def lookup(self, tokens: list[int]) -> tuple[list[Any] | None, int]:
        return None, 0

    def prefetch(self, tokens: list[int], on_done: Callable[[], None]) -> Any | None:
        """Start making ready, off the critical path, what `lookup(tokens)` would restore from
        slow tiers; None when there is nothing worth doing ahead. `on_done` is called (on some
        thread) when background reads are over; the engine calls `advance` each loop until it
        says ready, then `take` and `lookup`. The object's `needs_engine` says whether
        `advance` still has work for the engine thread (else the engine may sleep until
        `on_done`)."""
        return None

    def advance(self, prefetched: Any, move: bool, alone: bool = False) -> bool:
        """Engine thread, each loop: a bounded piece of the prefetch's own work (only with
        `move`; `alone`: no other request runs or waits, so all of it); True once it is ready."""
        return True

    def take(self, prefetched: Any) -> None:
        """Make a finished prefetch's blocks available to the next `lookup`."""
        return None

    def store(self, tokens: list[int], cache: list[Any], *, final: bool, start: int = 0) -> int:
        """Store the blocks of `tokens` from token `start` on that are not cached yet; 0 when
        done, else where the blocks left for later begin (the engine calls again from there
        with the same cache while idle, `_continue_store`)."""
        return 0

    def record(self, prompt_tokens: int, cached_tokens: int) -> None:
        return None

    def wants_prompt_blocks(self, prompt_tokens: int, cached_tokens: int) -> bool:
        """Whether a just-prefilled prompt has new full blocks worth extracting now."""
        return False

    def observe_prefill(self, tokens: int, depth: int, seconds: float) -> None:
        """A measured prefill (`tokens` computed after `depth` restored ones), for
        restore-or-recompute decisions."""
        return None

    def prefill_seconds(self, tokens: int, depth: int) -> float | None:
        """What prefilling `tokens` after `depth` cached ones takes here, as measured (None:
        not known)."""
        return None

    def write_back(self, idle: bool) -> bool:
        """Move some stored blocks on to slower tiers (engine thread); True when it moved some
        and more wait (call again soon)."""
        return False

    def probe_idle(self) -> None:
        """Engine thread, while idle: time a slow tier's restore where a request would have to
        (never measured, or due again), so that no request pays for it."""
        return None

    def hold_writes(self, on: bool) -> None:
        """While on, background writes of blocks to slower tiers wait (a lone prompt's prefill,
        whose TTFT they would stretch)."""
        return None

    def hot_bytes(self) -> int:
        """Bytes the hot tier holds in the device's memory (it yields them before a request
        is refused for memory)."""
        return 0

    def yield_memory(self, nbytes: int) -> int:
        """Move at least `nbytes` of hot blocks on to slower tiers (or drop them), least
        recently used first; the bytes freed."""
        return 0

    def close(self, timeout: float) -> None:
        """At shutdown: move everything still waiting, for up to `timeout` seconds."""
        return None
