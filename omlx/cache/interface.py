"""What an engine asks of its model's prefix cache (`PrefixCacheInterface`, every member on the
engine's thread), the shape of its blocks (`BlockSpec`), and the cache that caches nothing
(`NoCache`: `--no-cache`, and models the prefix cache cannot serve)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from omlx.cache.block.hashing import ExtraKeys
from omlx.cache.block.kinds import CacheKinds
from omlx.cache.loader.loading import Loading
from omlx.cache.plan.restore_plan import RestorePlan
from omlx.cache.plan.why import explain

# what the engine does to a restored (cache, tokens) before using it: cut it onto its prefill grid
Fit = Callable[[list[Any] | None, int], tuple[list[Any] | None, int]]


@dataclass(frozen=True)
class BlockSpec:
    """How a model's blocks are cut: `block_size` tokens (0: nothing is cached) and, where some layers are
    not plain KV, their `kinds`: a prefill chunk then ends on each block boundary, where the engine takes
    a `snapshot` of their state for `store` (docs/design/cache-kinds.md)."""

    block_size: int = 0
    kinds: CacheKinds | None = None

    @property
    def captures_states(self) -> bool:
        """Whether the engine must end chunks on `capture_points` and take snapshots there."""
        return self.block_size > 0 and self.kinds is not None

    def capture_points(self, prompt_len: int, cached: int) -> list[int]:
        """The token indices where a prefill chunk must end for a `snapshot`: the block boundaries after
        `cached` and before the prompt's last token; none for a plain-KV model."""
        if not self.captures_states:
            return []
        size = self.block_size
        return list(range((cached // size + 1) * size, prompt_len, size))

    def at_boundary(self, length: int) -> bool:
        """Whether a sequence of `length` tokens ends on a block boundary (a state to capture there)."""
        return self.captures_states and length % self.block_size == 0

    def snapshot(self, cache: list[Any], row: int | None = None) -> Any | None:
        """The state of `cache`'s stateful layers at its current length (a batch of one, or that `row` of a
        batch cache), for `store(boundary_states={length: snapshot})`; None: nothing to capture."""
        if not self.captures_states:
            return None
        from omlx.cache.block import layer_states  # MLX: only where a model has such layers

        return layer_states.snapshot(self.kinds, cache, row)


@runtime_checkable
class PrefixCacheInterface(Protocol):
    """The contract between an engine and its model's prefix cache (docs/design/cache-threads.md)."""

    blocks: BlockSpec

    def match(
        self, tokens: list[int], grid: int = 0, *, resumed: bool = False, image_keys: ExtraKeys | None = None
    ) -> RestorePlan:
        """What `tokens` would restore (once per admission; no MLX, nothing read): at least one token is left
        to compute; `grid`: the engine's prefill grid; `resumed`: a paused sequence's (not counted);
        `image_keys`: each image's digest at its first token (`block_keys`' extra keys)."""
        ...

    def load(self, plan: RestorePlan, on_ready: Callable[[], None] = lambda: None) -> Loading:
        """Start carrying out `plan`: what it makes ready ahead begins (`on_ready`, any thread, when the reads
        are over); the request waits (RESTORING) while the result's `pending` is true."""
        ...

    def advance(self, loading: Loading, move: bool, alone: bool = False) -> bool:
        """A bounded piece of `loading`'s engine-thread work (only with `move`; `alone`: nothing else runs or
        waits, so all of it); True once it is ready for `cache_for`."""
        ...

    def cache_for(self, loading: Loading, fit: Fit | None = None) -> tuple[list[Any] | None, int]:
        """The model's cache for the plan (the rest restored in line) and its length, after `fit`; (None, 0)
        when nothing is restored. Counts a request's prompt and its cached tokens (`plan.counted`) and
        leaves `loading.report`: what came from which tier, and why not more (`why.explain`)."""
        ...

    def store(
        self,
        tokens: list[int],
        cache: list[Any],
        *,
        final: bool,
        start: int = 0,
        boundary_states: dict[int, Any] | None = None,
        image_keys: ExtraKeys | None = None,
    ) -> int:
        """Store the blocks of `tokens` (final: what the engine keeps) from token `start` on not cached yet (with
        stateful layers, up to the first block end missing from `boundary_states`; `image_keys` as `match`'s);
        0 when done, else where the blocks left for a later call (same cache, while idle) begin."""
        ...

    def tick(self, idle: bool, *, quiet: bool = True) -> bool:
        """The cache's own background work, a bounded piece per loop (not during a lone prefill):
        write-back, and while `idle` (and `quiet`: no other engine of the process busy) the slow
        tiers' timing and its measurements' save. True while more work waits (call again soon)."""
        ...

    def hold_writes(self, on: bool) -> None:
        """While on, background writes to slower tiers wait (a lone prompt's prefill)."""
        ...

    def yield_memory(self, nbytes: int) -> int:
        """Move at least `nbytes` of device memory's blocks to slower tiers (or drop them), least recently
        used first; the bytes freed."""
        ...

    def hot_bytes(self) -> int:
        """Bytes the hot tier holds in the device's memory."""
        ...

    def observe_prefill(self, tokens: int, depth: int, seconds: float) -> None:
        """A measured prefill (`tokens` computed after `depth` restored ones)."""
        ...

    def close(self, timeout: float) -> None:
        """At shutdown: move everything still waiting, for up to `timeout` seconds."""
        ...


class NoCache:
    """The prefix cache that caches nothing: every plan restores nothing, every store is dropped."""

    blocks = BlockSpec()

    def match(
        self, tokens: list[int], grid: int = 0, *, resumed: bool = False, image_keys: ExtraKeys | None = None
    ) -> RestorePlan:
        return RestorePlan(len(tokens), 0, stores_after_prefill=False, counted=not resumed)

    def load(self, plan: RestorePlan, on_ready: Callable[[], None] = lambda: None) -> Loading:
        return Loading(plan)

    def advance(self, loading: Loading, move: bool, alone: bool = False) -> bool:
        return True

    def cache_for(self, loading: Loading, fit: Fit | None = None) -> tuple[list[Any] | None, int]:
        loading.report = explain(loading.plan)
        return None, 0

    def store(
        self,
        tokens: list[int],
        cache: list[Any],
        *,
        final: bool,
        start: int = 0,
        boundary_states: dict[int, Any] | None = None,
        image_keys: ExtraKeys | None = None,
    ) -> int:
        return 0

    def tick(self, idle: bool, *, quiet: bool = True) -> bool:
        return False

    def hold_writes(self, on: bool) -> None:
        return None

    def yield_memory(self, nbytes: int) -> int:
        return 0

    def hot_bytes(self) -> int:
        return 0

    def observe_prefill(self, tokens: int, depth: int, seconds: float) -> None:
        return None

    def close(self, timeout: float) -> None:
        return None
