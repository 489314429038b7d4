"""A stateful model's side of `PrefixCache` (rotating windows, recurrent arrays): capture points,
snapshots, the states a store needs at its blocks' ends, and the hot tier's KV-only copies.
Mixed into `PrefixCache`. Why: docs/design/cache-kinds.md."""

from __future__ import annotations

from typing import Any

from omlx.cache import layer_states
from omlx.cache.block import CacheBlock
from omlx.cache.cache_kinds import flatten
from omlx.cache.residency import Residency


class StatefulLayers:
    """`capture_points`, `snapshot` and the stateful parts of `store` and `lookup` of `PrefixCache`."""

    def _learn_size(self, block: CacheBlock) -> None:
        """The restore model's sizes from a block: KV bytes per token, and its whole state's bytes."""
        self.costs.learn_size(block.nbytes, block.token_count, layer_states.state_nbytes(block.tensors))

    def capture_points(self, prompt_len: int, cached: int) -> list[int]:
        """The token indices where a prefill chunk must end for `snapshot`: the block boundaries
        after `cached` and before the prompt's last token; none for a plain-KV model."""
        if self.kinds is None:
            return []
        return list(range((cached // self.B + 1) * self.B, prompt_len, self.B))

    def snapshot(self, cache: list[Any], row: int | None = None) -> Any | None:
        """The state of `cache`'s stateful layers at its current length (a batch of one, or `row` of
        a batch cache), for `store`'s `boundary_states` keyed by that length; None for plain KV."""
        return None if self.kinds is None else layer_states.snapshot(self.kinds, cache, row)

    def _cache_length(self, cache: list[Any], n_tokens: int) -> int:
        """Tokens `cache` holds: its first attention leaf's offset; `n_tokens` when it has none."""
        return next((int(leaf.offset) for leaf in flatten(cache) if hasattr(leaf, "offset")), n_tokens if cache else 0)

    def _kv_only(self, key: str) -> bool:
        """Whether the hot tier holds `key` as a KV-only copy (without its state)."""
        return bool(self.tiers.residency(key) & Residency.KV_ONLY)

    def _states_at_ends(
        self, new: list[tuple[str, str | None, int, int]], cache: list[Any], length: int, given: dict[int, Any]
    ) -> tuple[list[tuple[str, str | None, int, int]], dict[int, Any]]:
        """`new` up to the first block whose end has no complete state (`given`, or `cache` itself at its
        `length` when its layers tell it), a chain with a hole serving nothing after it; a block the hot
        tier holds KV-only is left out there (the chain goes on through its KV), stored whole with one."""
        states: dict[int, Any] = {}
        kept: list[tuple[str, str | None, int, int]] = []
        tells = any(hasattr(leaf, "offset") for leaf in flatten(cache))  # else `length` is the caller's word
        for spec in new:
            state = given.get(spec[3])
            if state is None and tells and spec[3] == length:
                state = layer_states.snapshot(self.kinds, cache)
            if layer_states.complete(self.kinds, state):
                kept.append(spec)
                states[spec[3]] = state
            elif not self._kv_only(spec[0]):
                break
        return kept, states
