"""What an engine asks of a prefix cache (`PrefixCacheInterface`; every method on the engine's
thread unless it says otherwise), and the cache that caches nothing (`NoCache`: `--no-cache`,
and models the prefix cache cannot serve)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class PrefixCacheInterface(Protocol):
    """The contract between an engine and its model's prefix cache."""

    block_size: int  # tokens per stored block (0: none)
    # the engine's prefill grid: a restored prefix is used only up to a multiple of it, so
    # `lookup` need not fetch what the engine would drop (0: none)
    grid: int

    def lookup(self, tokens: list[int]) -> tuple[list[Any] | None, int]:
        """The model's cache for the longest stored prefix of `tokens` worth restoring (at
        least one token is left to compute), and its length; (None, 0) when none."""
        ...

    def prefetch(self, tokens: list[int], on_done: Callable[[], None]) -> Any | None:
        """Start making ready off the critical path what `lookup(tokens)` would restore from slow
        tiers (None: nothing worth it); `on_done` is called (any thread) when reads are over, and
        the result's `needs_engine` says whether `advance` has engine-thread work left."""
        ...

    def advance(self, prefetched: Any, move: bool, alone: bool = False) -> bool:
        """A bounded piece of the prefetch's engine-thread work (only with `move`; `alone`:
        nothing else runs or waits, so all of it); True once it is ready for `take`."""
        ...

    def take(self, prefetched: Any) -> None:
        """Make a finished prefetch's blocks available to the next `lookup`."""
        ...

    def store(
        self,
        tokens: list[int],
        cache: list[Any],
        *,
        final: bool,
        start: int = 0,
        boundary_states: dict[int, Any] | None = None,
    ) -> int:
        """Store the blocks of `tokens` from token `start` on that are not cached yet (with stateful
        layers, up to the first block end missing from `boundary_states`); 0 when done, else where
        the blocks left for a later call (same cache, while idle) begin."""
        ...

    def capture_points(self, prompt_len: int, cached: int) -> list[int]:
        """Token indices where a prefill chunk must end so that `snapshot` can be taken there
        (block boundaries after `cached`); [] when the model's layers are all plain KV."""
        ...

    def snapshot(self, cache: list[Any], row: int | None = None) -> Any | None:
        """The state of `cache`'s stateful layers at its current length (a batch of one, or that
        `row` of a batch cache), for `store(boundary_states={length: snapshot})`; None: nothing to capture."""
        ...

    def record(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Count one request's prompt and the tokens of it served from the cache."""
        ...

    def wants_prompt_blocks(self, prompt_tokens: int, cached_tokens: int) -> bool:
        """Whether a just-prefilled prompt has new full blocks worth storing now."""
        ...

    def observe_prefill(self, tokens: int, depth: int, seconds: float) -> None:
        """A measured prefill (`tokens` computed after `depth` restored ones)."""
        ...

    def prefill_seconds(self, tokens: int, depth: int) -> float | None:
        """What prefilling `tokens` after `depth` cached ones takes here (None: not known)."""
        ...

    def tick(self, idle: bool, *, quiet: bool = True) -> bool:
        """The cache's own background work, a bounded piece per loop (not during a lone prefill):
        write-back, and while `idle` (and `quiet`: no other engine of the process busy) the slow
        tiers' timing and its measurements' save. True while more work waits (call again soon)."""
        ...

    def write_back(self, idle: bool) -> bool:
        """The write-back part of `tick`; True when it moved some and more wait."""
        ...

    def probe_idle(self) -> None:
        """The idle part of `tick`: time a slow tier where a request would otherwise have to."""
        ...

    def hold_writes(self, on: bool) -> None:
        """While on, background writes to slower tiers wait (a lone prompt's prefill)."""
        ...

    def hot_bytes(self) -> int:
        """Bytes the hot tier holds in the device's memory."""
        ...

    def yield_memory(self, nbytes: int) -> int:
        """Move at least `nbytes` of hot blocks to slower tiers (or drop them), least recently
        used first; the bytes freed."""
        ...

    def close(self, timeout: float) -> None:
        """At shutdown: move everything still waiting, for up to `timeout` seconds."""
        ...


class NoCache:
    """The prefix cache that caches nothing: every lookup misses, every store is dropped."""

    block_size = 0
    grid = 0

    def lookup(self, tokens: list[int]) -> tuple[list[Any] | None, int]:
        return None, 0

    def prefetch(self, tokens: list[int], on_done: Callable[[], None]) -> Any | None:
        return None

    def advance(self, prefetched: Any, move: bool, alone: bool = False) -> bool:
        return True

    def take(self, prefetched: Any) -> None:
        return None

    def store(
        self,
        tokens: list[int],
        cache: list[Any],
        *,
        final: bool,
        start: int = 0,
        boundary_states: dict[int, Any] | None = None,
    ) -> int:
        return 0

    def capture_points(self, prompt_len: int, cached: int) -> list[int]:
        return []

    def snapshot(self, cache: list[Any], row: int | None = None) -> Any | None:
        return None

    def record(self, prompt_tokens: int, cached_tokens: int) -> None:
        return None

    def wants_prompt_blocks(self, prompt_tokens: int, cached_tokens: int) -> bool:
        return False

    def observe_prefill(self, tokens: int, depth: int, seconds: float) -> None:
        return None

    def prefill_seconds(self, tokens: int, depth: int) -> float | None:
        return None

    def tick(self, idle: bool, *, quiet: bool = True) -> bool:
        return False

    def write_back(self, idle: bool) -> bool:
        return False

    def probe_idle(self) -> None:
        return None

    def hold_writes(self, on: bool) -> None:
        return None

    def hot_bytes(self) -> int:
        return 0

    def yield_memory(self, nbytes: int) -> int:
        return 0

    def close(self, timeout: float) -> None:
        return None
