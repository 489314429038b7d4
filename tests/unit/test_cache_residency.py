"""The block directory: one residency state per key, under one lock, for every model.

Blocks here are stand-ins (the directory only reads a block's key, fingerprint and size), so
the state machine is tested without MLX arrays; the real tiers' use of it is covered by
test_restore_decision.py.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from omlx.cache.residency import BlockDirectory, Residency


@dataclass
class Block:
    key: str
    fingerprint: str = "m"
    nbytes: int = 10


def test_a_stored_block_waits_for_the_writer_in_the_order_stored() -> None:
    d = BlockDirectory()
    a, b, c = Block("a"), Block("b"), Block("c", fingerprint="other")
    for block in (a, b, c):
        d.await_write(block)
    d.await_write(a)  # stored again: one wait, its place kept
    assert d.state("a") == Residency.UNWRITTEN and d.on_device("a")
    assert (d.unwritten("m"), d.unwritten_bytes("m"), d.unwritten_count()) == (2, 20, 3)
    assert d.next_unwritten("m") == (a, False)
    assert d.take_unwritten(a) and not d.take_unwritten(a)
    assert d.state("a") == Residency.NONE and d.unwritten_block("a") is None
    assert d.next_unwritten("m") == (b, False)


def test_one_let_go_on_another_thread_is_handed_over_first() -> None:
    d = BlockDirectory()
    a, b = Block("a"), Block("b")
    d.await_write(a)
    d.await_write(b)
    d.mark_evicted("b")
    d.mark_evicted("x")  # not waiting: nothing to mark
    assert d.state("b") == Residency.UNWRITTEN | Residency.EVICTED and d.state("x") == Residency.NONE
    assert d.next_unwritten("m") == (b, True)
    d.take_unwritten(b)
    assert d.next_unwritten("m") == (a, False)


def test_a_block_both_unwritten_and_leaving_keeps_its_device_copy_until_both_end() -> None:
    d = BlockDirectory()
    a = Block("a")
    d.await_write(a)
    assert d.leave(a, generation=0) and not d.leave(a, generation=0)  # the second only refreshes
    assert d.state("a") == Residency.UNWRITTEN | Residency.LEAVING and d.leaving_bytes == 10
    assert d.oldest_leaving("m") is a and d.oldest_leaving("other") is None
    d.take_unwritten(a)
    assert d.state("a") == Residency.LEAVING and d.on_device("a")
    assert d.reclaim("a") == (a, 0) and d.reclaim("a") == (None, 0)
    assert d.state("a") == Residency.NONE and d.leaving_bytes == 0 and not d.any_leaving()


def test_leaving_blocks_are_served_oldest_first_and_refreshed_when_let_go_again() -> None:
    d = BlockDirectory()
    a, b = Block("a"), Block("b")
    d.leave(a, 3)
    d.leave(b, 3)
    d.leave(a, 3)
    assert [x.key for x in d.leaving_blocks()] == ["b", "a"]
    assert d.oldest_leaving("m") is b and d.reclaim("b") == (b, 3)


def test_staged_reads_are_taken_once_and_dropped_per_model() -> None:
    d = BlockDirectory()
    d.stage(Block("a"))
    d.stage(Block("b", fingerprint="other"))
    assert d.is_staged("a") and d.state("a") == Residency.STAGED
    assert d.unstage("a").key == "a" and d.unstage("a") is None
    d.stage(Block("c"))
    d.unstage_all("m")
    assert not d.is_staged("c") and d.is_staged("b")


def test_dropping_a_model_s_waits_and_clearing_everything() -> None:
    d = BlockDirectory()
    for key in "abc":
        d.await_write(Block(key))
    d.await_write(Block("z", fingerprint="other"))
    d.leave(Block("l"), 0)
    assert d.drop_unwritten("m") == 3 and d.unwritten("m") == 0 and d.unwritten("other") == 1
    d.clear()
    assert d.unwritten_count() == 0 and d.leaving_bytes == 0 and d.state("z") == Residency.NONE


def test_every_state_change_is_under_the_one_lock() -> None:
    # a thread holding the lock sees no change by another until it lets go
    d = BlockDirectory()
    a = Block("a")
    changed = threading.Event()

    def other() -> None:
        d.await_write(a)
        changed.set()

    with d.lock:
        t = threading.Thread(target=other)
        t.start()
        assert not changed.wait(0.2) and d.state("a") == Residency.NONE
    t.join(5)
    assert changed.is_set() and d.state("a") == Residency.UNWRITTEN


def test_a_store_answers_each_block_s_residency_across_its_tiers(tmp_path) -> None:
    import numpy as np

    from omlx.cache.block import HostBlock
    from omlx.cache.hot_tier import HotTier
    from omlx.cache.ssd_tier import SSDTier
    from omlx.cache.store import CacheStore

    ssd = SSDTier(tmp_path, 1 << 20)
    assert ssd.wait_ready(10)
    store = CacheStore(HotTier(1000), ssd, 16, warm=HotTier(1000))
    assert store.hot.lock is store.directory.lock is store.warm.lock  # one lock
    hot, ram = Block("a" * 64), Block("b" * 64)
    store.hot.put(hot)
    store.warm.put(ram)
    store.directory.await_write(hot)
    assert store.residency(hot.key) == Residency.HOT | Residency.UNWRITTEN
    assert store.residency(ram.key) == Residency.RAM
    host = {"kv": ("uint8", (4,), np.arange(4, dtype=np.uint8))}
    written = HostBlock(ram.key, None, "m", 16, ["kv"], host)
    assert ssd.put(written) and ssd.flush(10)
    assert store.residency(ram.key, "m") == Residency.RAM | Residency.SSD
    assert store.residency(ram.key) == Residency.RAM  # the SSD asked only with a fingerprint
    store.clear()
    assert store.residency(hot.key, "m") == Residency.NONE
    store.close()
