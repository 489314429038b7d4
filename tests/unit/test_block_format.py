"""A block holds every layer's keys and values in one tensor, so a restore joins n blocks with
n copies instead of 2 x layers x n (the copies' launches were most of a hot hit's first
chunk on an H200); blocks in the per-layer format (an older version's SSD files, models
whose layers differ in shape) still restore, alone or in one chain with stacked ones.

Real tiers and KV caches; every restore is compared value for value with what was stored.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

import omlx.cache.saver.blocks as block_cutter
from omlx.cache.block import kv_layout
from omlx.cache.block.block import packed_on_host, staged_on_host
from omlx.cache.block.hashing import block_keys
from omlx.cache.block.kv_layout import KV_STACK, join_blocks
from omlx.cache.prefix_cache import PrefixCache
from tests.support.cache_parts import make_tiers, restore

B = 16
FP = "b" * 64
LAYERS = 3


def kv(tokens: int, heads: list[int] | None = None) -> list[KVCache]:
    """Random keys and values per layer, with spare capacity past `tokens` as a live cache has."""
    caches = []
    for layer, h in enumerate(heads or [2] * LAYERS):
        c = KVCache()
        k = mx.random.normal((1, h, tokens + 7, 8), key=mx.random.key(layer))
        v = mx.random.normal((1, h, tokens + 7, 8), key=mx.random.key(100 + layer))
        c.state = (k, v, tokens)
        caches.append(c)
    return caches


def hot_cache(layers: int = LAYERS) -> PrefixCache:
    return PrefixCache(make_tiers(B, 1 << 30), FP, layers, "m")


def ssd_cache(root: Path) -> PrefixCache:
    return PrefixCache(make_tiers(B, 1 << 30, ssd=root), FP, LAYERS, "m")


def stored_in_both_formats(
    cache: PrefixCache, tokens: list[int], original: list[KVCache], monkeypatch: pytest.MonkeyPatch
) -> PrefixCache:
    """`tokens` stored as a conversation's two turns: the first two blocks as an older version
    wrote them (a tensor per layer), the rest stacked."""
    with monkeypatch.context() as m:
        m.setattr(block_cutter, "stackable", lambda cache: False)
        cache.store(tokens[: 2 * B], original, final=True)
    cache.store(tokens, original, final=True)
    return cache


def written_and_closed(cache: PrefixCache) -> None:
    """Everything `cache` stored written to its SSD (as an idle engine does), then closed."""
    while cache.write_back.step(idle=True):
        pass
    cache.tiers.ssd.close()


def assert_restores(restored: list[KVCache], original: list[KVCache], n: int) -> None:
    assert len(restored) == len(original)
    for got, want in zip(restored, original, strict=True):
        assert got.offset == n and got.keys.shape[2] == n
        assert mx.array_equal(got.keys, want.keys[:, :, :n, :]).item()
        assert mx.array_equal(got.values, want.values[:, :, :n, :]).item()


def counted_joins(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of inputs of each `mx.concatenate` call from here on."""
    calls: list[int] = []
    real = mx.concatenate

    def counting(arrays: list[mx.array], *args: Any, **kwargs: Any) -> mx.array:
        calls.append(len(arrays))
        return real(arrays, *args, **kwargs)

    monkeypatch.setattr(mx, "concatenate", counting)
    return calls


def test_a_block_holds_every_layer_in_one_tensor_and_restores_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    cache, tokens = hot_cache(), list(range(1, 4 * B + 1))
    original = kv(len(tokens))
    cache.store(tokens, original, final=True)
    block = cache.tiers.device.peek(block_keys(FP, tokens, B)[0])
    assert list(block.tensors) == [KV_STACK]
    assert block.tensors[KV_STACK].shape == (2 * LAYERS, 2, B, 8)
    joins = counted_joins(monkeypatch)
    restored, n = restore(cache, tokens + [999])
    assert n == 4 * B
    assert joins == [4]  # one join of the four blocks, not one per layer and kind
    assert_restores(restored, original, n)


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("blocks", [1, 3])
def test_writes_into_a_restored_cache_never_reach_the_stored_blocks(
    stacked: bool, blocks: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a cache trimmed, then written in place (a padded chunk's trim, the next tokens): the
    # restored arrays may share the stored ones' memory, never their objects
    if not stacked:
        monkeypatch.setattr(block_cutter, "stackable", lambda cache: False)
    cache, tokens = hot_cache(), list(range(1, blocks * B + 1))
    cache.store(tokens, kv(len(tokens)), final=True)
    stored = [cache.tiers.device.peek(k) for k in block_keys(FP, tokens, B)]
    before = [{name: mx.array(t) for name, t in b.tensors.items()} for b in stored]
    restored = join_blocks([(b, B) for b in stored], LAYERS)
    for c in restored:
        c.trim(3)
        c.update_and_fetch(mx.ones((1, 2, 3, 8)), mx.ones((1, 2, 3, 8)))
        c.update_and_fetch(mx.ones((1, 2, 5, 8)), mx.ones((1, 2, 5, 8)))  # and past the end
    mx.eval([c.state[:2] for c in restored])
    assert all(mx.array_equal(c.keys[:, :, c.offset - 1, :], mx.ones((1, 2, 8))).item() for c in restored)
    for b, was in zip(stored, before, strict=True):
        assert all(mx.array_equal(b.tensors[name], t).item() for name, t in was.items())


def test_a_lone_stacked_tensor_is_copied_before_the_host_reads_it() -> None:
    # the SSD writer's and the RAM tier's host reads must not touch a kept block's own buffer
    # (on CUDA that buffer would turn into managed memory for good)
    t = mx.random.normal((2 * LAYERS, 2, B, 8))
    mx.eval(t)
    own = np.asarray(t).__array_interface__["data"][0]
    (_, _, host), = packed_on_host({KV_STACK: t}).values()
    staged, staged_host = staged_on_host({KV_STACK: t})
    for view in (host, staged_host[KV_STACK][2]):
        assert view.__array_interface__["data"][0] != own
    assert staged is not None
    assert np.array_equal(host.view(np.float32).reshape(t.shape), np.asarray(t))


def test_a_prefix_ending_inside_a_block_restores_its_first_tokens() -> None:
    cache, tokens = hot_cache(), list(range(1, 3 * B + 1))
    original = kv(len(tokens))
    cache.store(tokens, original, final=True)
    caches, n = restore(cache, tokens[: 2 * B + 5] + [999])  # a prompt that parts from it 5 tokens in
    assert n == 2 * B + 5
    assert_restores(caches, original, n)
    parts = [(cache.tiers.device.peek(k), B) for k in block_keys(FP, tokens, B)[:2]]
    parts[-1] = (parts[-1][0], 5)
    assert_restores(join_blocks(parts, LAYERS), original, B + 5)


def test_blocks_in_the_per_layer_format_still_restore_alone_and_mixed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokens = list(range(1, 4 * B + 1))
    original = kv(len(tokens))
    older = stored_in_both_formats(ssd_cache(tmp_path), tokens, original, monkeypatch)
    first = older.tiers.device.peek(block_keys(FP, tokens, B)[0])
    assert KV_STACK not in first.tensors and first.tensors["0.keys"].shape == (1, 2, B, 8)
    assert list(older.tiers.device.peek(block_keys(FP, tokens, B)[3]).tensors) == [KV_STACK]
    written_and_closed(older)

    again = ssd_cache(tmp_path)  # a restart: both formats come back from the SSD
    again.costs.prefill.observe(4 * B, 0, 100.0)  # recomputing is slow: restore
    caches, n = restore(again, tokens + [999])
    assert n == 4 * B
    assert_restores(caches, original, n)
    again.tiers.ssd.close()


def test_a_chain_of_both_formats_is_probed_and_restored_from_the_ssd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the SSD's first restore times a few blocks, read and used on the device together: with
    # the older blocks first in the chain that group holds both formats
    tokens = list(range(1, 32 * B + 1))
    original = kv(len(tokens))
    older = stored_in_both_formats(ssd_cache(tmp_path), tokens, original, monkeypatch)
    written_and_closed(older)

    again = ssd_cache(tmp_path)
    assert again.costs.ssd_rate.value is None  # never measured: the lookup times a part first
    again.costs.prefill.observe(32 * B, 0, 100.0)
    caches, n = restore(again, tokens + [999])
    assert n == 32 * B and again.costs.ssd_rate.value is not None
    assert_restores(caches, original, n)
    again.tiers.ssd.close()

    idle = ssd_cache(tmp_path)  # the idle engine's timing reads the same blocks
    deadline = time.monotonic() + 10
    while idle.costs.ssd_rate.value is None and time.monotonic() < deadline:
        idle.idle_probe.step()
        time.sleep(0.01)
    assert idle.costs.ssd_rate.value is not None
    idle.tiers.ssd.close()


def narrower_values(tokens: int) -> list[KVCache]:
    """Keys wider than values, as in multi-head latent attention."""
    caches = kv(tokens)[:2]
    for c in caches:
        c.values = c.values[..., :4]
    return caches


@pytest.mark.parametrize(
    "make", [lambda n: kv(n, heads=[2, 4]), narrower_values], ids=["layers-of-different-heads", "narrower-values"]
)
def test_tensors_of_different_shapes_keep_a_tensor_each(make: Any) -> None:
    cache, tokens = hot_cache(layers=2), list(range(1, 2 * B + 1))
    original = make(len(tokens))
    cache.store(tokens, original, final=True)
    block = cache.tiers.device.peek(block_keys(FP, tokens, B)[0])
    assert sorted(block.tensors) == ["0.keys", "0.values", "1.keys", "1.values"]
    caches, n = restore(cache, tokens + [999])
    assert n == 2 * B
    assert_restores(caches, original, n)


def test_a_store_stacks_runs_of_adjacent_blocks_once_within_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    # as on a GPU: one stack per run of adjacent blocks (2 x layers copies), each block cut from it
    tokens = list(range(1, 4 * B + 1))
    original = kv(len(tokens))
    block_bytes = 2 * LAYERS * 2 * B * 8 * 4  # float32
    monkeypatch.setattr(block_cutter, "stack_group_bytes", lambda: 1 << 30)
    joins = counted_joins(monkeypatch)
    cache = hot_cache()
    cache.store(tokens, original, final=True)
    assert joins == [2 * LAYERS]  # one stack for the four blocks
    assert cache.tiers.device.peek(block_keys(FP, tokens, B)[0]).nbytes == block_bytes
    monkeypatch.setattr(block_cutter, "stack_group_bytes", lambda: 2 * block_bytes)
    joins.clear()
    bounded = hot_cache()
    bounded.store(tokens, original, final=True)
    assert joins == [2 * LAYERS, 2 * LAYERS]  # two blocks' bytes at a time
    monkeypatch.setattr(block_cutter, "stack_group_bytes", lambda: 0)
    joins.clear()
    alone = hot_cache()  # as on a CPU: each block stacked on its own, its bytes copied once
    alone.store(tokens, original, final=True)
    assert joins == [2 * LAYERS] * 4
    for c in (cache, bounded, alone):
        caches, n = restore(c, tokens + [999])
        assert n == 4 * B
        assert_restores(caches, original, n)


def test_a_cpu_store_makes_each_block_with_one_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    # cutting blocks from a shared stack copies their bytes a second time: not where copies
    # cost bandwidth rather than launches
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    assert block_cutter.stack_group_bytes() == 0
    cuts: list[int] = []
    real = mx.contiguous
    monkeypatch.setattr(mx, "contiguous", lambda a, *args, **kw: cuts.append(1) or real(a, *args, **kw))
    hot_cache().store(list(range(1, 4 * B + 1)), kv(4 * B), final=True)
    assert cuts == []


@pytest.mark.parametrize("layers_per_array", [1, 2, 3])
def test_a_restore_too_large_for_one_array_joins_its_layers_in_groups(
    layers_per_array: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a joined array lives until its last layer has grown out of it: a restore joins in groups
    # (one array of all 32 layers of a 47,872-token 8B restore ran the GPU out of memory)
    cache, tokens = hot_cache(), list(range(1, 3 * B + 1))
    original = kv(len(tokens))
    cache.store(tokens, original, final=True)
    parts = [(cache.tiers.device.peek(k), B) for k in block_keys(FP, tokens, B)]
    per_layer = 2 * 2 * 8 * 3 * B  # keys and values of one layer, all three blocks
    joins = counted_joins(monkeypatch)
    restored = join_blocks(parts, LAYERS, max_elements=layers_per_array * per_layer)
    assert joins == [3] * -(-LAYERS // layers_per_array)  # one join of the 3 blocks per group
    assert_restores(restored, original, 3 * B)


def test_a_restore_joins_groups_of_at_most_join_group_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    cache, tokens = hot_cache(), list(range(1, 3 * B + 1))
    original = kv(len(tokens))
    cache.store(tokens, original, final=True)
    parts = [(cache.tiers.device.peek(k), B) for k in block_keys(FP, tokens, B)]
    layer_bytes = 2 * 2 * 8 * 3 * B * 4  # keys and values of one float32 layer, all three blocks
    monkeypatch.setattr(kv_layout, "JOIN_GROUP_BYTES", 2 * layer_bytes)
    joins = counted_joins(monkeypatch)
    restored = join_blocks(parts, LAYERS)
    assert joins == [3, 3]  # layers 0-1, then 2
    assert_restores(restored, original, 3 * B)
