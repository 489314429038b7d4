"""Every tier's states live in the block directory: HOT and RAM while the hot and RAM tiers hold
a block, WRITING while it is queued or being written, SSD while its file is indexed, under the
directory's one lock (every tier's), which the SSD writer never holds across file I/O."""

from __future__ import annotations

import hashlib
import random
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np

from omlx.cache.block.block import CacheBlock, HostBlock
from omlx.cache.tiers.memory_tier import MemoryTier
from omlx.cache.tiers.residency import SSD_STATES, BlockDirectory, Residency
from omlx.cache.tiers.ssd.tier import SSDTier
from omlx.cache.tiers.tiers import Tiers
from tests.support.cache_parts import make_tiers

FP = "m"


def host_block(i: int, nbytes: int = 1000, fp: str = FP) -> HostBlock:
    key = hashlib.sha256(f"{fp}-{i}".encode()).hexdigest()
    host = {"kv": ("uint8", (nbytes,), np.full(nbytes, i % 251, dtype=np.uint8))}
    return HostBlock(key, None, fp, 16, ["kv"], host)


def open_store(root: Path, ssd_bytes: int = 1 << 30, demote_bound: int = 0) -> tuple[Tiers, SSDTier]:
    store = make_tiers(16, 1 << 20, ram_bytes=1 << 20, ssd=root, ssd_bytes=ssd_bytes, demote_bound=demote_bound)
    return store, store.ssd


def consistent(ssd: SSDTier) -> bool:
    """SSD in a key's state exactly while the index holds it; no write left pending."""
    d = ssd.directory
    return d.keys_with(Residency.SSD) == set(ssd._index) and not d.keys_with(Residency.WRITING)


def test_the_ssd_tier_and_the_store_share_one_directory_and_one_lock(tmp_path: Path) -> None:
    store, ssd = open_store(tmp_path)
    assert store.directory is ssd.directory
    assert ssd._lock is store.directory.lock is store.device.lock is store.ram.lock
    alone = SSDTier(tmp_path / "alone", 1 << 20)  # without tiers: a directory (and lock) of its own
    assert isinstance(alone.directory, BlockDirectory) and alone.directory is not store.directory
    given = BlockDirectory()
    assert SSDTier(tmp_path / "given", 0, directory=given).directory is given
    alone.close()
    store.close()


def test_a_block_is_writing_then_on_the_ssd_then_gone_after_eviction(tmp_path: Path) -> None:
    store, ssd = open_store(tmp_path)
    gate, inside = threading.Event(), threading.Event()
    real = ssd._write_file

    def slow(path, host, metadata):  # type: ignore[no-untyped-def]
        inside.set()
        assert gate.wait(10)
        real(path, host, metadata)

    ssd._write_file = slow  # type: ignore[method-assign]
    a = host_block(1)
    assert ssd.put(a) and inside.wait(10)  # the writer is inside the file write now
    assert store.residency(a.key, FP) == Residency.WRITING == store.directory.state(a.key)
    assert ssd.writing(a.key) and not ssd.put(a)  # queued once
    assert store.directory.lock.acquire(timeout=5)  # the writer holds no lock across the write
    store.directory.lock.release()
    gate.set()
    assert ssd.flush(10)
    assert store.residency(a.key, FP) == Residency.SSD == store.directory.state(a.key)
    assert store.residency(a.key) == Residency.NONE  # the SSD asked only with a fingerprint
    assert store.residency(a.key, "other") == Residency.NONE  # another model's key
    ssd._max_bytes = ssd.stats()["bytes"]  # room for one file: the next write pushes it out
    b = host_block(2)
    assert ssd.put(b) and ssd.flush(10)
    assert store.residency(a.key, FP) == Residency.NONE and ssd.stats()["evictions"] >= 1
    assert consistent(ssd)
    store.close()


def test_a_clear_drops_every_state_the_ssd_s_with_its_files(tmp_path: Path) -> None:
    store, ssd = open_store(tmp_path)
    blocks = [host_block(i) for i in range(4)]
    for block in blocks:
        assert ssd.put(block)
    assert ssd.flush(10)
    store.directory.await_write(blocks[0])  # also waits for the writer (a stand-in)
    assert store.directory.state(blocks[0].key) == Residency.UNWRITTEN | Residency.SSD
    store.clear()
    assert all(store.residency(b.key, FP) == Residency.NONE for b in blocks)
    assert not store.directory.keys_with(~Residency.NONE) and consistent(ssd)
    store.close()


def test_a_directory_clear_alone_keeps_the_ssd_tier_s_states() -> None:
    d = BlockDirectory()
    d.mark("a", Residency.SSD)
    d.mark("b", Residency.WRITING)
    d.demote_later(host_block(4))
    d.clear()
    assert d.state("a") == Residency.SSD and d.state("b") == Residency.WRITING
    assert d.keys_with(~Residency.NONE) == {"a", "b"} == d.keys_with(SSD_STATES)
    d.unmark("a", Residency.SSD)
    assert d.state("a") == Residency.NONE


def test_a_restart_indexes_every_file_as_ssd_in_the_directory(tmp_path: Path) -> None:
    store, ssd = open_store(tmp_path)
    blocks = [host_block(i) for i in range(3)]
    for block in blocks:
        assert ssd.put(block)
    store.close()
    fresh, ssd2 = open_store(tmp_path)
    assert all(fresh.residency(b.key, FP) == Residency.SSD for b in blocks) and consistent(ssd2)
    fresh.close()


def test_concurrent_puts_reads_and_evictions_keep_directory_and_index_consistent(tmp_path: Path) -> None:
    store, ssd = open_store(tmp_path, ssd_bytes=6000)  # room for a few blocks: most are evicted
    errors: list[BaseException] = []

    def writer(first: int) -> None:
        try:
            for i in range(first, first + 40):
                ssd.put(host_block(i))
                store.residency(host_block(i - 1).key, FP)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    def reader() -> None:
        try:
            for i in range(120):
                for future in ssd.read_ahead([host_block(i).key], FP):
                    future.result(10)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n * 40,)) for n in range(3)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and ssd.flush(30)
    assert consistent(ssd) and ssd.stats()["bytes"] <= 6000 and ssd.stats()["evictions"] > 0
    on_ssd = {b.key for b in map(host_block, range(120)) if store.residency(b.key, FP) & Residency.SSD}
    assert on_ssd == set(ssd._index)
    store.close()


# ----- the hot and RAM tiers record HOT and RAM in the same directory -------------------
def device_block(i: int, nbytes: int = 1000, fp: str = FP) -> CacheBlock:
    key = hashlib.sha256(f"{fp}-{i}".encode()).hexdigest()
    return CacheBlock(key, None, fp, 16, ["kv"], {"kv": mx.full((nbytes,), i % 251, dtype=mx.uint8)})


def entries(d: BlockDirectory) -> set[str]:
    """Every key the directory has an entry for (one with no state left must have none)."""
    with d.lock:
        return set(d._entries)


def test_a_block_is_hot_then_demoting_then_in_ram_then_gone(tmp_path: Path) -> None:
    store, ssd = open_store(tmp_path, demote_bound=1 << 20)  # let go, a block waits for its own engine's copy to RAM
    store.device.set_max_bytes(2000)  # room for two blocks
    store.own(FP)
    d = store.directory
    a, b, c = device_block(1), device_block(2), device_block(3)
    assert store.device.put(a) and store.device.put(b)
    assert d.state(a.key) == Residency.HOT == store.residency(a.key, FP)
    assert d.keys_with(Residency.HOT) == {a.key, b.key}
    assert store.device.put(c)  # pushes `a` out: it waits in device memory
    assert d.state(a.key) == Residency.DEMOTING == store.residency(a.key, FP)
    assert not store.demote(FP, limit=1 << 30, due=True)[0]
    assert d.state(a.key) == Residency.RAM == store.residency(a.key, FP)
    assert store.ram.take(a.key) is not None  # moved back toward the device: in no tier now
    assert d.state(a.key) == Residency.NONE and a.key not in entries(d)
    store.device.discard(b.key)
    store.device.shed(1 << 30)  # `c` let go: it waits, then is copied to RAM
    assert d.keys_with(Residency.HOT) == set() and d.state(c.key) == Residency.DEMOTING
    assert not store.demote(FP, limit=1 << 30, due=True)[0] and d.keys_with(Residency.RAM) == {c.key}
    store.clear()
    assert entries(d) == set()
    store.close()


def test_a_tier_alone_has_a_lock_of_its_own_and_the_tiers_give_theirs_at_construction() -> None:
    hot = MemoryTier(3000)  # alone (as tests build it): its own lock, no directory to record in
    blocks = [device_block(i) for i in range(4)]
    for block in blocks:
        hot.put(block)
    assert hot.stats()["blocks"] == 3 and hot.stats()["evictions"] == 1
    store = make_tiers(16, 3000)  # the tiers' lock is made once, by them, and given to each tier as it is made
    assert store.device.lock is store.lock is store.directory.lock and hot.lock is not store.lock
    for block in blocks:
        store.device.put(block)
    assert store.directory.keys_with(Residency.HOT) == {b.key for b in blocks[1:]}
    store.device.clear()
    assert entries(store.directory) == set()


# ----- KV-only hot copies (a stateful restore's run): HOT and KV_ONLY, never handed on -------
def kv_only(block: CacheBlock) -> CacheBlock:
    """`block`'s KV-only read: fewer bytes, marked `partial` (docs/design/cache-kinds.md)."""
    half = {name: t[: t.shape[0] // 2] for name, t in block.tensors.items()}
    return CacheBlock(block.key, block.parent, block.fingerprint, block.token_count, list(block.layer_types), half, partial=True)


def test_a_kv_only_hot_copy_is_marked_upgraded_by_a_whole_put_and_never_replaces_one(tmp_path: Path) -> None:
    store, ssd = open_store(tmp_path)
    evicted: list[CacheBlock] = []
    store.device.on_evict = evicted.append
    a = device_block(1)
    part = kv_only(a)
    assert store.device.put(part) and store.residency(a.key, FP) == Residency.HOT | Residency.KV_ONLY
    assert store.device.held_bytes == part.nbytes == 500
    assert store.device.put(a)  # the whole block upgrades the KV-only copy: not an eviction
    assert store.device.peek(a.key) is a and store.device.held_bytes == 1000 and not evicted
    assert store.residency(a.key, FP) == Residency.HOT and store.device.stats()["evictions"] == 0
    b = device_block(2)
    assert store.device.put(b) and store.device.put(kv_only(a))  # a KV-only put keeps the whole one, refreshed
    assert store.device.peek(a.key) is a and store.residency(a.key, FP) == Residency.HOT
    assert list(store.device._blocks) == [b.key, a.key]
    store.device.discard(a.key)
    assert a.key not in entries(store.directory)  # no state left: no entry
    store.device.set_max_bytes(1600)  # room for `b` and a KV-only `a`, not for both whole
    assert store.device.put(kv_only(a), keep={b.key})
    assert not store.device.put(a, keep={b.key})  # the whole one does not fit: the KV-only copy stays
    assert store.device.peek(a.key).partial and store.residency(a.key, FP) == Residency.HOT | Residency.KV_ONLY
    store.close()


def test_the_ram_and_ssd_tiers_refuse_a_kv_only_block(tmp_path: Path) -> None:
    store, ssd = open_store(tmp_path)
    part = kv_only(device_block(1))
    for put in (store.ram.put, ssd.put):
        try:
            put(HostBlock.of(part, copy=True) if put == store.ram.put else part)
        except ValueError:
            continue
        raise AssertionError(f"{put} took a block without its state")
    assert entries(store.directory) == set() and store.ram.stats()["blocks"] == 0
    store.close()


def test_a_kv_only_copy_let_go_by_the_hot_tier_is_dropped_never_copied_or_written(tmp_path: Path) -> None:
    store, ssd = open_store(tmp_path, demote_bound=1 << 20)
    store.own(FP)
    followed: list[tuple[CacheBlock, HostBlock | None]] = []
    store.follow(FP, lambda block, host: followed.append((block, host)))
    d = store.directory
    whole, part = device_block(1), kv_only(device_block(2))
    d.await_write(device_block(2))  # even one whose whole block waits for the SSD writer
    assert store.device.put(whole) and store.device.put(part)
    store.device.shed(1 << 30)
    assert d.state(whole.key) == Residency.DEMOTING  # the whole one waits for its copy to RAM
    assert d.state(part.key) == Residency.UNWRITTEN and not d.is_demoting(part.key)  # the KV-only one: dropped
    assert not store.demote(FP, limit=1 << 30, due=True)[0]
    assert [b.key for b, _ in followed] == [whole.key] and store.ram.peek(part.key) is None
    store.demotion.bound = 0  # copied to RAM at once when let go: still not the KV-only one
    assert store.device.put(kv_only(device_block(3)))
    store.device.set_max_bytes(0)
    assert store.ram.stats()["blocks"] == 1 and len(followed) == 1 and ssd.stats()["blocks"] == 0
    store.close()


def test_hot_ram_and_kv_only_keys_follow_the_tiers_through_random_changes() -> None:
    rng = random.Random(31)
    whole = [device_block(i, nbytes=rng.choice((500, 1000, 1500)), fp=rng.choice((FP, "n"))) for i in range(12)]
    pool = whole + [kv_only(b) for b in whole]
    store = make_tiers(16, 4000, ram_bytes=6000, demote_bound=2000)
    store.own(FP)
    hot, warm, d = store.device, store.ram, store.directory
    assert warm is not None
    ops = [
        lambda b: hot.put(b, keep={rng.choice(pool).key}),
        lambda b: hot.take(b.key),
        lambda b: hot.discard(b.key),
        lambda b: hot.shed(rng.choice((500, 3000))),
        lambda b: hot.set_max_bytes(rng.choice((2000, 4000, 6000))),
        lambda b: hot.discard_fingerprint(b.fingerprint),
        lambda b: None if b.partial else warm.put(HostBlock.of(b, copy=True)),
        lambda b: warm.take(b.key),
        lambda b: warm.set_max_bytes(rng.choice((3000, 6000))),
        lambda b: store.demote(FP, limit=rng.choice((1, 1 << 30)), due=True),
        lambda b: store.reclaim(b.key),
        lambda b: None if b.partial else d.await_write(b),
        lambda b: None if b.partial else d.take_unwritten(b),
        lambda b: store.clear() if rng.random() < 0.1 else None,
    ]
    for step in range(600):
        rng.choice(ops)(rng.choice(pool))
        in_hot = {b.key for b in whole if hot.contains(b.key)}
        partial = {b.key for b in whole if hot.contains(b.key) and hot.peek(b.key).partial}
        in_ram = {b.key for b in whole if warm.contains(b.key)}
        assert d.keys_with(Residency.HOT) == in_hot and d.keys_with(Residency.KV_ONLY) == partial, step
        assert d.keys_with(Residency.RAM) == in_ram and not any(warm.peek(k).partial for k in in_ram), step
        assert not any(b.partial for b in d.demoting_blocks()), step
        waiting = d.keys_with(Residency.UNWRITTEN | Residency.DEMOTING)
        assert entries(d) == in_hot | in_ram | waiting, step  # no key left without a state
        assert all(store.residency(b.key) == d.state(b.key) for b in whole), step
    store.clear()
    assert entries(d) == set() and hot.stats()["bytes"] == 0 == warm.stats()["bytes"]
