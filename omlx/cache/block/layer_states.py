"""The block tensors of a model with stateful layers (format 3): KV leaves as token ranges, the
others as their state at the block's end (a rotating window's last keys and values in order, a
recurrent layer's arrays); and the model's cache rebuilt from a chain of such blocks."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from omlx.cache.block.block import CacheBlock, is_state_tensor
from omlx.cache.block.kinds import ARRAYS, KV, ROTATING, CacheKinds, flatten, regroup
from omlx.cache.block.kv_layout import first_tokens, kv_cache

# A snapshot: tensor name -> array, every stateful leaf's state at one token index
Snapshot = dict[str, mx.array]


def window_in_order(cache: RotatingKVCache) -> tuple[mx.array, mx.array]:
    """A rotating window's keys and values in temporal order: its first `keep` tokens and the
    last ones up to `max_size` in all, what any later token may attend to."""
    keys, values, offset, keep, max_size, idx = cache.state
    n = min(offset, max_size)

    def ordered(v: mx.array) -> mx.array:
        if idx == v.shape[2]:
            pass
        elif idx < offset:  # rotated: the oldest tokens after the kept ones start at idx
            v = mx.concatenate([v[..., :keep, :], v[..., idx:, :], v[..., keep:idx, :]], axis=2)
        else:
            v = v[..., :idx, :]
        if v.shape[2] > n:  # a prefill chunk leaves up to max_size - 1 + its length
            tail = v[..., v.shape[2] - (n - keep) :, :]
            v = mx.concatenate([v[..., :keep, :], tail], axis=2) if keep else tail
        return mx.contiguous(v)

    return ordered(keys), ordered(values)


def snapshot(kinds: CacheKinds, cache: list[Any], row: int | None = None) -> Snapshot:
    """Every stateful leaf's state now (a batch-of-one cache, or `row` of a batch cache: only
    those leaves are extracted), named as block tensors; new arrays, unchanged by later writes."""
    out: Snapshot = {}
    for i, (kind, leaf) in enumerate(zip(kinds.leaves, flatten(cache), strict=True)):
        if row is not None and kind.kind != KV:
            leaf = leaf.extract(row)  # mlx-lm's own: a batch window without its row's padding
        if kind.kind == ROTATING:
            out[f"{i}.window.keys"], out[f"{i}.window.values"] = window_in_order(leaf)
        elif kind.kind == ARRAYS:
            for j, a in enumerate(leaf.cache):
                if a is not None:
                    out[f"{i}.arrays.{j}"] = a[...]
    return out


def complete(kinds: CacheKinds, state: Snapshot | None) -> bool:
    """Whether `state` holds every rotating leaf's window and some array of each recurrent leaf."""
    if state is None:
        return False
    for i, kind in enumerate(kinds.leaves):
        if kind.kind == ROTATING and f"{i}.window.keys" not in state:
            return False
        if kind.kind == ARRAYS and not any(f"{i}.arrays.{j}" in state for j in range(kind.slots)):
            return False
    return True


def block_tensors(kinds: CacheKinds, cache: list[Any], a: int, b: int, state: Snapshot) -> dict[str, mx.array]:
    """A block's tensors for tokens a..b: KV leaves' keys and values of those tokens, and the
    other leaves' `state` captured at token b."""
    tensors: dict[str, mx.array] = {}
    for i, (kind, leaf) in enumerate(zip(kinds.leaves, flatten(cache), strict=True)):
        if kind.kind == KV:
            tensors[f"{i}.keys"] = mx.contiguous(leaf.keys[:, :, a:b, :])
            tensors[f"{i}.values"] = mx.contiguous(leaf.values[:, :, a:b, :])
    tensors.update(state)
    return tensors


def state_nbytes(tensors: dict[str, mx.array]) -> int:
    """Bytes of a block's whole-state tensors (what does not grow with its token count)."""
    return sum(int(t.nbytes) for name, t in tensors.items() if is_state_tensor(name))


def restore(kinds: CacheKinds, parts: list[tuple[CacheBlock, int]]) -> list[Any]:
    """The model's cache after a chain's blocks (`(block, n)`: its first n tokens; the last block
    used whole): KV leaves joined from every block, the other leaves from the last block's state."""
    offset = sum(n for _, n in parts)
    last = parts[-1][0].tensors
    leaves: list[Any] = []
    for i, kind in enumerate(kinds.leaves):
        if kind.kind == KV:
            keys = [first_tokens(b.tensors[f"{i}.keys"], n, b.token_count) for b, n in parts]
            values = [first_tokens(b.tensors[f"{i}.values"], n, b.token_count) for b, n in parts]
            leaves.append(kv_cache(_joined(keys), _joined(values)))
        elif kind.kind == ROTATING:
            # new array objects: the cache writes into its arrays in place once its window is full
            k, v = last[f"{i}.window.keys"][...], last[f"{i}.window.values"][...]
            c = RotatingKVCache(max_size=kind.window, keep=kind.keep)
            c.state = (k, v, offset, kind.keep, kind.window, k.shape[2])
            leaves.append(c)
        elif kind.kind == ARRAYS:
            c = ArraysCache(kind.slots)
            c.cache = [last[f"{i}.arrays.{j}"][...] if f"{i}.arrays.{j}" in last else None for j in range(kind.slots)]
            leaves.append(c)
    return regroup(kinds, leaves)


def _joined(pieces: list[mx.array]) -> mx.array:
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)
