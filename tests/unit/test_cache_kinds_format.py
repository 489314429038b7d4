"""Cache kinds without a model run: detection from mlx-lm cache classes, the fingerprint, the
block format version (4 for stateful blocks, each part read and verified alone; 1 to 3 still
read; others discarded), the factory's choice, the capture points, the restore model's state bytes."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)
from safetensors import TensorSpec, serialize

from omlx.cache.block.block import CacheBlock, HostBlock, checksum_host
from omlx.cache.block.kinds import cache_kinds, flatten, regroup
from omlx.cache.plan import decide
from omlx.cache.plan.restore_model import RestoreModel
from omlx.cache.prefix_cache import PrefixCache
from omlx.cache.tiers.ssd import format as ssd_format
from omlx.cache.tiers.ssd.tier import SSDTier
from tests.support.cache_parts import make_tiers

FP = "a" * 64


def test_kinds_are_read_per_layer_with_windows_and_cache_list_parts() -> None:
    cache = [RotatingKVCache(max_size=128), KVCache(), CacheList(ArraysCache(size=2), KVCache()), ArraysCache(size=1)]
    kinds, why = cache_kinds(cache)
    assert why == "" and kinds is not None
    assert kinds.tags() == ["rotating:128:0", "kv", "arrays:2", "kv", "arrays:1"]
    assert kinds.groups == (0, 0, 2, 0) and kinds.stateful and not kinds.plain_kv
    rebuilt = regroup(kinds, flatten(cache))
    assert [type(c) for c in rebuilt] == [type(c) for c in cache]
    assert [type(c) for c in rebuilt[2].caches] == [ArraysCache, KVCache]


def test_plain_kv_models_keep_their_fingerprint_field_and_windows_change_it() -> None:
    plain, _ = cache_kinds([KVCache(), KVCache()])
    assert plain is not None and plain.plain_kv and plain.kv_format() == "kv"  # their old blocks stay valid
    small, _ = cache_kinds([RotatingKVCache(max_size=8), KVCache()])
    large, _ = cache_kinds([RotatingKVCache(max_size=40), KVCache()])
    assert small.kv_format() != large.kv_format() != "kv"


@pytest.mark.parametrize("layer", [QuantizedKVCache(), ChunkedKVCache(64), CacheList(CacheList(KVCache()))])
def test_cache_classes_blocks_cannot_hold_are_named(layer) -> None:
    kinds, why = cache_kinds([KVCache(), layer])
    assert kinds is None and type(layer.caches[0] if isinstance(layer, CacheList) else layer).__name__ in why








def stateful_block(i: int, tokens: int = 16) -> CacheBlock:
    tensors = {
        "0.keys": mx.full((1, 2, tokens, 8), float(i)),
        "0.values": mx.full((1, 2, tokens, 8), float(i) + 0.5),
        "1.arrays.0": mx.full((1, 3, 8), 2.0),
        "1.arrays.1": mx.full((1, 2, 4, 4), 3.0),
    }
    key = hashlib.sha256(f"{FP}-{i}".encode()).hexdigest()
    return CacheBlock(key, None, FP, tokens, ["kv", "arrays:2"], tensors)


def header(path: Path) -> dict:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def test_stateful_blocks_are_format_4_and_come_back_with_their_kinds(tmp_path: Path) -> None:
    block = stateful_block(0)
    tier = SSDTier(tmp_path, 1 << 30)
    assert tier.wait_ready(10) and tier.put(block) and tier.flush(10)
    meta = header(tier.path_for(block.key))["__metadata__"]
    assert meta["format_version"] == "4" and meta["checksum"] != meta["state_checksum"]
    tier.close()
    tier = SSDTier(tmp_path, 1 << 30)  # re-indexed at start: format 4 is readable
    assert tier.wait_ready(10) and tier.contains(block.key, FP)
    read = tier.get(block.key, FP)
    assert read is not None and read.layer_types == ["kv", "arrays:2"] and not read.partial
    assert all(mx.array_equal(read.tensors[n], t).item() for n, t in block.tensors.items())
    kv, state = tier.get(block.key, FP, part="kv"), tier.get(block.key, FP, part="state")
    assert sorted(kv.tensors) == ["0.keys", "0.values"] and sorted(state.tensors) == ["1.arrays.0", "1.arrays.1"]
    assert kv.partial and state.partial and kv.token_count == 16
    assert all(mx.array_equal(p.tensors[n], block.tensors[n]).item() for p in (kv, state) for n in p.tensors)
    tier.close()


def test_plain_kv_blocks_keep_format_2_and_one_checksum() -> None:
    tensors = {"0.keys": mx.ones((1, 2, 16, 8)), "0.values": mx.zeros((1, 2, 16, 8))}
    block = HostBlock.of(CacheBlock("b" * 64, None, FP, 16, ["kv"], tensors), copy=False)
    assert ssd_format.block_metadata(block) == {
        "format_version": "2", "key": "b" * 64, "parent": "", "token_count": "16", "fingerprint": FP,
        "layer_types": '["kv"]', "checksum": checksum_host(block.host),
    }  # fmt: skip


def write_format_3(tier: SSDTier, block: CacheBlock) -> Path:
    """`block` as a build before format 4 wrote it: one checksum over every tensor."""
    host = HostBlock.of(block, copy=False)
    meta = ssd_format.block_metadata(host)
    meta.update(format_version="3", checksum=checksum_host(host.host))
    del meta["state_checksum"]
    path = tier.path_for(block.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        ssd_format.write_block(f, host.host, meta)
    return path


def test_block_files_are_the_bytes_safetensors_would_write(tmp_path: Path) -> None:
    """`write_block` streams each tensor from its buffer (the GIL released) instead of building
    the file in `safetensors.serialize`; the file must hold what that writes (its metadata comes
    out in hash order, so the comparison is by parts), each tensor aligned to its element size."""
    mixed = stateful_block(3)
    mixed.tensors["0.keys"] = mixed.tensors["0.keys"].astype(mx.bfloat16)  # 2-byte alignment
    mixed.tensors["1.arrays.0"] = mx.arange(21, dtype=mx.uint8).reshape(1, 3, 7)  # 1-byte, odd size
    for block in (mixed, stateful_block(4, tokens=5)):
        host = HostBlock.of(block, copy=False)
        meta = ssd_format.block_metadata(host)
        specs = {
            name: TensorSpec(dtype=dt, shape=list(shape), data_ptr=data.ctypes.data, data_len=data.nbytes)
            for name, (dt, shape, data) in host.host.items()
        }
        path = tmp_path / "block.safetensors"
        with open(path, "wb") as f:
            ssd_format.write_block(f, host.host, meta)
        ours, theirs = path.read_bytes(), serialize(specs, meta)
        assert len(ours) == len(theirs)
        parts = []
        for raw in (ours, theirs):
            (n,) = struct.unpack("<Q", raw[:8])
            assert n % 8 == 0
            head = json.loads(raw[8 : 8 + n])
            data = {
                name: (info["dtype"], info["shape"], raw[8 + n + info["data_offsets"][0] : 8 + n + info["data_offsets"][1]])
                for name, info in head.items()
                if name != "__metadata__"
            }
            parts.append((head["__metadata__"], data))
            for name, info in head.items():
                if name != "__metadata__":
                    size = 2 if info["dtype"] in ("BF16", "F16") else 1 if info["dtype"] == "U8" else 4
                    assert info["data_offsets"][0] % size == 0, (name, info)
        assert parts[0] == parts[1] and parts[0][0] == meta
        loaded, _ = ssd_format.load_block(path, block.key, block.fingerprint)
        assert loaded.host.keys() == host.host.keys()
        assert all(loaded.host[n][:2] == t[:2] and (loaded.host[n][2] == t[2]).all() for n, t in host.host.items())


def test_format_3_files_still_load_whole_and_by_part(tmp_path: Path) -> None:
    block = stateful_block(3)
    write_format_3(SSDTier(tmp_path, 0), block)
    tier = SSDTier(tmp_path, 1 << 30)
    assert tier.wait_ready(10) and tier.contains(block.key, FP)
    whole, kv = tier.get(block.key, FP), tier.get(block.key, FP, part="kv")
    assert sorted(whole.tensors) == sorted(block.tensors) and sorted(kv.tensors) == ["0.keys", "0.values"]
    assert all(mx.array_equal(whole.tensors[n], t).item() for n, t in block.tensors.items())
    assert tier.stats()["discarded"] == 0
    tier.close()


def flip(path: Path, name: str) -> None:
    """Invert the bytes of tensor `name` in a block file."""
    raw = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    start, stop = header(path)[name]["data_offsets"]
    raw[8 + n + start : 8 + n + stop] = bytes(b ^ 0xFF for b in raw[8 + n + start : 8 + n + stop])
    path.write_bytes(bytes(raw))


def test_a_part_read_takes_only_its_bytes_and_verifies_them(tmp_path: Path, monkeypatch) -> None:
    block = stateful_block(4, tokens=64)
    tier = SSDTier(tmp_path, 1 << 30)
    assert tier.wait_ready(10) and tier.put(block) and tier.flush(10)
    path = tier.path_for(block.key)
    counted: list[int] = []

    class Counting:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def read(self, *a):
            data = self.f.read(*a)
            counted.append(len(data))
            return data

        def readinto(self, buf):
            counted.append(self.f.readinto(buf))
            return counted[-1]

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(ssd_format, "open", lambda *a: Counting(open(*a)), raising=False)
    head = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    state = sum(int(t.nbytes) for n, t in block.tensors.items() if ".arrays." in n)
    for part, nbytes in (("kv", block.nbytes - state), ("state", state), ("all", block.nbytes)):
        counted.clear()
        assert tier.get(block.key, FP, part=part) is not None
        assert sum(counted) == head + nbytes, part  # the header and that part's tensors, nothing else
    flip(path, "1.arrays.1")  # a state tensor damaged: the KV part still verifies
    assert tier.get(block.key, FP, part="kv") is not None and tier.stats()["discarded"] == 0
    assert tier.get(block.key, FP, part="state") is None and tier.stats()["discarded"] == 1
    assert tier.put(block) and tier.flush(10)
    flip(path, "0.values")  # a KV tensor damaged: found by a KV read
    assert tier.get(block.key, FP, part="kv") is None and tier.stats()["discarded"] == 2
    tier.close()


def test_a_build_that_knows_only_formats_1_to_3_discards_format_4(tmp_path: Path, monkeypatch) -> None:
    block = stateful_block(1)
    tier = SSDTier(tmp_path, 1 << 30)
    assert tier.wait_ready(10) and tier.put(block) and tier.flush(10)
    tier.close()
    monkeypatch.setattr(ssd_format, "READABLE_FORMATS", ("1", "2", "3"))
    tier = SSDTier(tmp_path, 1 << 30)
    assert tier.wait_ready(10)
    assert not tier.contains(block.key, FP) and tier.stats()["discarded"] == 1
    tier.close()


def test_an_unknown_format_version_is_discarded_never_served(tmp_path: Path, monkeypatch) -> None:
    block = stateful_block(2)
    monkeypatch.setattr(ssd_format, "STATEFUL_FORMAT_VERSION", "5")  # a later build's file
    tier = SSDTier(tmp_path, 1 << 30)
    assert tier.wait_ready(10) and tier.put(block) and tier.flush(10)
    tier.close()
    monkeypatch.undo()
    tier = SSDTier(tmp_path, 1 << 30)
    assert tier.wait_ready(10)
    assert tier.get(block.key, FP) is None and tier.stats()["discarded"] == 1
    tier.close()


def test_the_restore_model_counts_one_whole_state_per_restore() -> None:
    model = RestoreModel(stateful=True)
    model.learn_size(16 * 100 + 5000, 16, state_bytes=5000)
    assert model.bytes_per_token == 100 and model.state_bytes == 5000
    assert model.restore_bytes(16) == 1600 + 5000 and model.restore_bytes(40) == 4000 + 5000
    assert model.restore_bytes(16 * 125) == 125 * 1600 + 5000  # the state is read once, whatever the run
    assert model.restore_bytes(0) == 0
    again = RestoreModel(stateful=True)
    again.load(model.state())
    assert again.restore_bytes(40) == model.restore_bytes(40)
    plain = RestoreModel()
    plain.learn_size(1600, 16)
    assert plain.restore_bytes(40) == 4000  # plain KV: bytes per token alone, as before


def test_a_store_stops_at_the_first_block_without_its_state(tmp_path: Path) -> None:
    kinds, _ = cache_kinds([KVCache(), ArraysCache(size=1)])
    store = make_tiers(16, 1 << 30)
    pc = PrefixCache(store, FP, 2, "m", kinds=kinds)
    kv = KVCache()
    kv.state = (mx.zeros((1, 2, 50, 8)), mx.zeros((1, 2, 50, 8)), 50)
    arrays = ArraysCache(size=1)
    arrays.cache = [mx.ones((1, 3, 8))]
    cache = [kv, arrays]
    snap = pc.blocks.snapshot(cache)
    pc.store(list(range(50)), cache, final=False, boundary_states={16: snap, 48: snap})  # none at 32
    assert store.device.stats()["blocks"] == 1  # block 3 and the tail would hang off a hole
    pc.store(list(range(50)), cache, final=False, boundary_states={32: snap, 48: snap})
    assert store.device.stats()["blocks"] == 4  # blocks 2, 3 and the tail, at the cache's own length




def test_a_model_of_recurrent_layers_alone_is_judged_on_its_states() -> None:
    model = RestoreModel(stateful=True)
    model.learn_size(5000, 16, state_bytes=5000)  # mamba2: no KV at all
    model.learn_size(9999, 3, state_bytes=9999)  # learned once, from the first block seen
    assert model.bytes_per_token == 0 and model.restore_bytes(32) == model.restore_bytes(3200) == 5000
    for n in (100, 200, 400):
        model.prefill.observe(n, 0, n * 0.01)
    model.ssd_rate.observe(10000, 10.0)  # 1 kB/s: far slower than recomputing 32 tokens (0.32 s)
    assert decide.verdict(32, 0, model.ssd_rate.snapshot(), model.costs()).restore is False  # judged, not waved through as unmeasured


@pytest.mark.parametrize("keep", [0, 2])
@pytest.mark.parametrize("steps", [[5], [12], [5, 1, 1, 1, 1, 1, 1, 1], [12, 1, 1, 7, 1]])
def test_a_window_restored_in_order_goes_on_as_the_original(keep: int, steps: list[int]) -> None:
    from omlx.cache.block.layer_states import window_in_order

    kinds, _ = cache_kinds([RotatingKVCache(max_size=8, keep=keep)])
    original = RotatingKVCache(max_size=8, keep=keep)
    key = iter(mx.random.split(mx.random.key(keep), 64))

    def feed(c: RotatingKVCache, n: int, k: mx.array) -> tuple[mx.array, mx.array]:
        x = mx.random.normal((1, 2, n, 4), key=k)
        return c.update_and_fetch(x, x + 1)

    for n in steps:
        feed(original, n, next(key))
    keys, values = window_in_order(original)
    assert keys.shape[2] == min(8, sum(steps))
    block = CacheBlock("k" * 64, None, FP, sum(steps), kinds.tags(), {"0.window.keys": keys, "0.window.values": values})
    from omlx.cache.block.layer_states import restore

    (restored,) = restore(kinds, [(block, sum(steps))])
    for n in (1, 1, 6, 1, 9, 1):  # decode steps and chunks: what each attends to stays the same
        k = next(key)
        feed(original, n, k), feed(restored, n, k)
        assert mx.array_equal(window_in_order(original)[0], window_in_order(restored)[0]).item()
        assert restored.offset == original.offset
