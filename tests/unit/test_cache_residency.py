"""The block directory: one residency state per key, under one lock, for every model.

Blocks here are stand-ins (the directory only reads a block's key, fingerprint and size), so
the state machine is tested without MLX arrays; the real tiers' use of it is covered by
test_restore_decision.py.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from omlx.cache.tiers.residency import BlockDirectory, Residency
from tests.support.cache_parts import make_tiers


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


def test_a_block_both_unwritten_and_demoting_keeps_its_device_copy_until_both_end() -> None:
    d = BlockDirectory()
    a = Block("a")
    d.await_write(a)
    assert d.demote_later(a) and not d.demote_later(a)  # the second only refreshes
    assert d.state("a") == Residency.UNWRITTEN | Residency.DEMOTING and d.demoting_bytes == 10
    assert d.oldest_demoting("m") is a and d.oldest_demoting("other") is None
    d.take_unwritten(a)
    assert d.state("a") == Residency.DEMOTING and d.on_device("a")
    assert d.reclaim("a") == (a, 0) and d.reclaim("a") == (None, 0)
    assert d.state("a") == Residency.NONE and d.demoting_bytes == 0 and not d.any_demoting()


def test_demoting_blocks_are_served_oldest_first_and_refreshed_when_let_go_again() -> None:
    d = BlockDirectory()
    a, b = Block("a"), Block("b")
    d.clear(), d.clear(), d.clear()  # generation 3
    d.demote_later(a)
    d.demote_later(b)
    d.demote_later(a)
    assert [x.key for x in d.demoting_blocks()] == ["b", "a"]
    assert d.oldest_demoting("m") is b and d.reclaim("b") == (b, 3)


def test_dropping_a_model_s_waits_and_clearing_everything() -> None:
    d = BlockDirectory()
    for key in "abc":
        d.await_write(Block(key))
    d.await_write(Block("z", fingerprint="other"))
    d.demote_later(Block("l"))
    assert d.drop_unwritten("m") == 3 and d.unwritten("m") == 0 and d.unwritten("other") == 1
    d.clear()
    assert d.unwritten_count() == 0 and d.demoting_bytes == 0 and d.state("z") == Residency.NONE
    assert d.generation == 1  # what was stored or let go before the clear is not written or copied


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

    from omlx.cache.block.block import HostBlock

    store = make_tiers(16, 1000, ram_bytes=1000, ssd=tmp_path, ssd_bytes=1 << 20)
    ssd = store.ssd
    assert store.device.lock is store.directory.lock is store.ram.lock is store.lock  # one lock, the tiers' own
    hot, ram = Block("a" * 64), Block("b" * 64)
    store.device.put(hot)
    store.ram.put(ram)
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
