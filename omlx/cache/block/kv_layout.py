"""How a block's tensors hold a model's KV cache (one `KV_STACK` tensor where every layer's
keys and values share a shape, else a tensor per layer and kind, the older format), and how
blocks become the model's cache again."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from omlx.cache.block.block import CacheBlock
from omlx.cache.block.kinds import flatten

# A block's tensor holding every layer's keys and values, (2 x layers, heads, tokens, head dim):
# keys of layer l at 2l, its values at 2l + 1. Blocks of models whose layers differ in shape
# keep a tensor per layer and kind ("0.keys", "0.values" ...), as blocks written before did.
KV_STACK = "kv"
# The most bytes one joined array of a restore may hold: each is kept until the last of its
# layers has grown out of it in the first chunk, so a restore needs up to this much memory on top
# of the restored cache. One array of all layers needed twice the restored bytes and, with
# other models' processes on the GPU, ran it out of memory, which MLX's CUDA backend turned
# into a lost context (docs/design/long-context.md, docs/design/ram-moves.md).
JOIN_GROUP_BYTES = 1 << 30
# and the most elements (MLX 0.32 reads views past 2**31 elements correctly,
# tests/gpu/test_large_array_views.py; kept below it all the same)
MAX_ARRAY_ELEMENTS = 2**31 - 1
# On a GPU a store stacks at most this many bytes of adjacent blocks at once (transient memory)
STACK_GROUP_BYTES = 256 << 20


def stack_group_bytes() -> int:
    """How many bytes of adjacent blocks a store stacks at once: on a GPU, where every copy is
    a kernel launch, `STACK_GROUP_BYTES`; on a CPU none (each block is stacked on its own,
    one copy of its bytes, where cutting it from a shared stack would copy them twice)."""
    return STACK_GROUP_BYTES if mx.default_device().type == mx.gpu else 0


def stackable(cache: list[Any]) -> bool:
    """Whether every layer's keys and values (batch of 1) have one shape but for their length,
    and one dtype, so a block can hold them as one `KV_STACK` tensor."""
    first = cache[0].keys
    return all(
        t.ndim == 4 and t.shape[0] == 1 and t.shape[1] == first.shape[1] and t.shape[3] == first.shape[3]
        and t.dtype == first.dtype
        for c in cache for t in (c.keys, c.values)
    )  # fmt: skip


def layer_tensors(cache: list[Any], a: int, b: int) -> dict[str, mx.array]:
    """Tokens a..b of every layer as a tensor per layer and kind (layers that differ in shape)."""
    tensors = {}
    for layer, c in enumerate(cache):
        tensors[f"{layer}.keys"] = mx.contiguous(c.keys[:, :, a:b, :])
        tensors[f"{layer}.values"] = mx.contiguous(c.values[:, :, a:b, :])
    return tensors


def _layer_kv(block: CacheBlock, layer: int) -> tuple[mx.array, mx.array]:
    """A block's keys and values of one layer, (1, heads, tokens, head dim), in either format."""
    kv = block.tensors.get(KV_STACK)
    if kv is not None:
        return kv[2 * layer][None], kv[2 * layer + 1][None]
    return block.tensors[f"{layer}.keys"], block.tensors[f"{layer}.values"]


def first_tokens(t: mx.array, n: int, token_count: int) -> mx.array:
    """A view of `t`'s first `n` tokens (axis 2); a new array object even for all of them:
    handed to a KV cache as they are, a block's own arrays would change with the cache's
    writes (MLX's `a[...] = x` updates the object `a`)."""
    return t[:, :, : min(n, token_count), :]


def kv_cache(keys: mx.array, values: mx.array) -> KVCache:
    c = KVCache()
    c.state = (keys, values, keys.shape[2])
    return c


def join_blocks(
    parts: list[tuple[CacheBlock, int]], num_layers: int, max_elements: int = MAX_ARRAY_ELEMENTS
) -> list[KVCache]:
    """One KV cache per layer from a chain's blocks (`(block, n)`: its first n tokens); stacked
    blocks are joined with one copy each per group of layers of at most `JOIN_GROUP_BYTES` and
    `max_elements`, each layer's arrays views of its group's (docs/design/ram-moves.md)."""
    if all(KV_STACK in block.tensors for block, _ in parts):
        stacks = [first_tokens(block.tensors[KV_STACK], n, block.token_count) for block, n in parts]
        rows, heads, _, dim = stacks[0].shape
        per_layer = 2 * heads * dim * sum(s.shape[2] for s in stacks)
        by_bytes = JOIN_GROUP_BYTES // max(1, per_layer * stacks[0].dtype.size)
        group = max(1, min(num_layers, max_elements // per_layer, by_bytes))  # layers per joined array
        caches = []
        for first in range(0, num_layers, group):
            lo, hi = 2 * first, 2 * min(num_layers, first + group)
            pieces = [s if (lo, hi) == (0, rows) else s[lo:hi] for s in stacks]
            kv = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)
            caches += [kv_cache(kv[r][None], kv[r + 1][None]) for r in range(0, hi - lo, 2)]
        return caches
    caches = []
    for layer in range(num_layers):
        keys, values = [], []
        for block, n in parts:
            k, v = _layer_kv(block, layer)
            keys.append(first_tokens(k, n, block.token_count))
            values.append(first_tokens(v, n, block.token_count))
        k = keys[0] if len(keys) == 1 else mx.concatenate(keys, axis=2)
        v = values[0] if len(values) == 1 else mx.concatenate(values, axis=2)
        caches.append(kv_cache(k, v))
    return caches


def kv_bytes_per_token(model: Any) -> int:
    """Bytes each token adds to the model's KV cache (its KVCache leaves, also inside a CacheList;
    rotating windows and recurrent state do not grow with the sequence), from a one-token pass."""
    cache = make_prompt_cache(model)
    model(mx.array([[0]]), cache=cache)
    mx.eval([c.state for c in cache])
    return sum(
        (c.keys.nbytes + c.values.nbytes) // c.keys.shape[2]
        for c in flatten(cache) if type(c) is KVCache and c.keys is not None
    )  # fmt: skip
