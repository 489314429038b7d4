"""Blocks cut from a model's cache (engine thread): token ranges of KV, and for a model with stateful
layers their state at each block's end; on a GPU adjacent blocks are cut from one stack of their run
(far fewer launches: docs/design/ram-moves.md, "Making and joining blocks")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from omlx.cache.block import layer_states
from omlx.cache.block.block import CacheBlock
from omlx.cache.block.kinds import CacheKinds, flatten
from omlx.cache.block.kv_layout import KV_STACK, layer_tensors, stack_group_bytes, stackable

# (key, parent key or None, first token, end token) of a block to make
Spec = tuple[str, str | None, int, int]


@dataclass(frozen=True)
class BlockCutter:
    """Makes one model's blocks (`fingerprint`, `num_layers` leaves, their `kinds` or None for plain KV)."""

    fingerprint: str
    num_layers: int
    block_size: int
    kinds: CacheKinds | None = None

    def cut(self, cache: list[Any], specs: list[Spec], states: dict[int, Any] | None = None) -> list[CacheBlock]:
        """Blocks of `cache` for `specs` (with stateful layers, their `states` at each end); on a GPU, stacked
        blocks are cut from one stack of each run of adjacent ranges (`STACK_GROUP_BYTES` at a time)."""
        if not specs:
            return []
        if states is not None:
            return [self.block(k, p, b - a, layer_states.block_tensors(self.kinds, cache, a, b, states[b])) for k, p, a, b in specs]
        if not stackable(cache):
            return [self.block(key, parent, b - a, layer_tensors(cache, a, b)) for key, parent, a, b in specs]
        per_token = 2 * len(cache) * cache[0].keys.shape[1] * cache[0].keys.shape[3] * cache[0].keys.itemsize
        most = max(1, stack_group_bytes() // max(1, per_token * self.block_size))
        blocks: list[CacheBlock] = []
        group: list[Spec] = []
        for spec in [*specs, None]:
            if group and (spec is None or spec[2] != group[-1][3] or len(group) == most):
                blocks += self._stacked(cache, group)
                group = []
            if spec is not None:
                group.append(spec)
        return blocks

    def _stacked(self, cache: list[Any], group: list[Spec]) -> list[CacheBlock]:
        """Adjacent `group` cut from one stack of every layer's keys and values over its tokens."""
        lo, hi = group[0][2], group[-1][3]
        stack = mx.concatenate([t[:, :, lo:hi, :] for c in cache for t in (c.keys, c.values)])
        cut = len(group) > 1  # else the stack is the block
        return [
            self.block(key, parent, b - a, {KV_STACK: mx.contiguous(stack[:, :, a - lo : b - lo, :]) if cut else stack})
            for key, parent, a, b in group
        ]

    def block(self, key: str, parent: str | None, token_count: int, tensors: dict[str, mx.array]) -> CacheBlock:
        return CacheBlock(
            key=key, parent=parent, fingerprint=self.fingerprint, token_count=token_count,
            layer_types=["kv"] * self.num_layers if self.kinds is None else self.kinds.tags(), tensors=tensors,
        )  # fmt: skip


def cache_length(cache: list[Any], n_tokens: int) -> int:
    """Tokens `cache` holds: its first attention leaf's offset; `n_tokens` when it has none."""
    return next((int(leaf.offset) for leaf in flatten(cache) if hasattr(leaf, "offset")), n_tokens if cache else 0)


def kv_bytes_per_block(cache: list[Any], block_size: int) -> int:
    """A full block's KV bytes estimated from `cache`'s layers (before any block was measured)."""
    return block_size * sum(
        leaf.keys.nbytes // max(1, leaf.keys.shape[2]) * 2 for leaf in flatten(cache) if getattr(leaf, "keys", None) is not None
    )  # fmt: skip
