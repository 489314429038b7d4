"""Restore-or-recompute from the first request on: measurements persist beside the SSD
blocks, and a tier never measured is timed on one block before a whole run is restored.

Real tiers (an SSD directory, a hot tier in memory) and real KV caches made by a store;
only the prefill timings are fed in by hand, to stand for a fast or a slow device.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from omlx.cache.block.hashing import block_keys
from omlx.cache.block.kv_layout import KV_STACK
from omlx.cache.plan.restore_plan import Tier
from omlx.cache.prefix_cache import PrefixCache
from omlx.cache.saver.blocks import BlockCutter
from omlx.cache.saver.write_back import CopyPacer
from omlx.cache.tiers.ssd.tier import SSDTier
from omlx.cache.tiers.tiers import Tiers
from tests.support.cache_parts import make_tiers, read_ahead, restore

B = 16
FP = "f" * 64
LAYERS = 2


def open_cache(root: Path) -> PrefixCache:
    """A fresh process's view: empty hot tier, the SSD directory as left on disk."""
    return PrefixCache(make_tiers(B, 1 << 30, ssd=root), FP, LAYERS, "m")


def kv(tokens: int) -> list[KVCache]:
    caches = []
    for layer in range(LAYERS):
        c = KVCache()
        k = mx.random.normal((1, 2, tokens, 8), key=mx.random.key(layer))
        c.state = (k, k + 1, tokens)
        caches.append(c)
    return caches


def stored(root: Path, tokens: list[int]) -> None:
    cache = open_cache(root)
    cache.store(tokens, kv(len(tokens)), final=True)
    while cache.write_back.step(idle=True):  # what an idle engine does
        pass
    cache.tiers.ssd.close()


def test_measurements_survive_a_restart(tmp_path: Path) -> None:
    cache = open_cache(tmp_path)
    cache.observe_prefill(1000, 0, 0.5)
    cache.close(timeout=1.0)  # as its engine stops
    cache.tiers.ssd.close()
    again = open_cache(tmp_path)
    assert again.costs.prefill.seconds(1000) == cache.costs.prefill.seconds(1000) == 0.5
    again.tiers.ssd.close()


def test_measurements_are_written_off_the_engine_thread(tmp_path: Path, monkeypatch) -> None:
    # they are saved before a request's first token and during its restore: the engine thread
    # must not wait on the disk (busy with the SSD writer's fsyncs) for them
    writing, release = threading.Event(), threading.Event()
    real = Path.write_text

    def slow_disk(self: Path, text: str, *args: Any, **kwargs: Any) -> int:
        if "costs" in self.parts and threading.current_thread().name == "omlx-cache-costs":
            writing.set()
            release.wait(10)
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", slow_disk)
    cache = open_cache(tmp_path)
    cache.observe_prefill(1000, 0, 0.5)
    assert writing.wait(10)  # a helper thread is writing, and this thread is not held by it
    cache.observe_prefill(1000, 0, 0.1)
    release.set()
    cache.close(timeout=1.0)  # as the engine stops: the newest state, written here
    cache.tiers.ssd.close()
    again = open_cache(tmp_path)
    assert again.costs.prefill.seconds(1000) == cache.costs.prefill.seconds(1000) < 0.5
    again.tiers.ssd.close()


def test_ram_restores_saved_before_moves_count_as_copies(tmp_path: Path) -> None:
    # until 2026-12-01 every RAM restore was a copy (1.7 GB/s on an H200): as the rate of
    # moves (6.4 GB/s) it would make the cache recompute what it should now restore
    cache = open_cache(tmp_path)
    cache.observe_prefill(1000, 0, 0.5)
    cache.close(timeout=1.0)
    cache.tiers.ssd.close()
    path = cache.cost_file.path
    state = json.loads(path.read_text())
    state.pop("warm_moves"), state.pop("warm_copies")
    path.write_text(json.dumps({**state, "warm_restores": [1.7e9, 1.0]}))
    again = open_cache(tmp_path)
    assert again.costs.ram_move_rate.value is None and again.costs.ram_copy_rate.value == 1.7e9
    again.tiers.ssd.close()


def test_an_older_measurement_finishing_late_does_not_overwrite_a_newer_one(tmp_path: Path) -> None:
    cache = open_cache(tmp_path)
    cache.cost_file.write(2, '{"newer": true}')
    cache.cost_file.write(1, '{"older": true}')  # a thread that started earlier and ran late
    assert cache.cost_file.path.read_text() == '{"newer": true}'
    cache.tiers.ssd.close()


def test_unmeasured_ssd_is_probed_on_one_block_when_recompute_is_fast(tmp_path: Path) -> None:
    # an eighth of the run at once (2 blocks here) cost a first SSD restore of 32,000 tokens
    # on an H200 1.0 s before recomputing 1.35 s: the probe grows only while it is expected
    # to stay within PROBE_SHARE of recomputing the whole run
    tokens = list(range(10, 10 + 16 * B + 1))
    stored(tmp_path, tokens)
    cache = open_cache(tmp_path)
    cache.costs.prefill.observe(100_000, 0, 1e-6)  # a device that prefills 10^11 tokens/s
    caches, n = restore(cache, tokens)
    assert n == B  # the probe (1 of 16 blocks) only; the other 15 are recomputed
    assert caches[0].offset == B
    assert cache.costs.ssd_rate.value is not None and cache.tiers.counters.skipped_restores == 1
    cache.tiers.ssd.close()


def test_an_unmeasured_tier_is_probed_up_to_an_eighth_in_growing_groups(tmp_path: Path, monkeypatch) -> None:
    tokens = list(range(10, 10 + 64 * B + 1))
    stored(tmp_path, tokens)
    cache = open_cache(tmp_path)
    groups: list[int] = []
    real = cache.tiers.ssd.get_many
    monkeypatch.setattr(cache.tiers.ssd, "get_many", lambda keys, fp: groups.append(len(keys)) or real(keys, fp))
    cache.costs.prefill.observe(100, 0, 100.0)  # recomputing is slow: the probe may take its eighth
    caches, n = restore(cache, tokens)
    assert groups == [1, 2, 4, 1, 56] and n == 64 * B  # 8 blocks probed, then the rest restored


def test_a_tier_judged_slower_is_probed_again_after_a_while(tmp_path: Path) -> None:
    # measured once while the disk was busy, the SSD would otherwise never be used again
    from omlx.cache.plan.restore_model import REPROBE_AFTER

    tokens = list(range(10, 10 + 8 * B + 1))
    stored(tmp_path, tokens)
    cache = open_cache(tmp_path)
    cache.costs.prefill.observe(100, 0, 100.0)  # recomputing is slow: one token per second
    cache.costs.ssd_rate.observe(1, 1e9)  # ...and the SSD "slower"
    cache.costs.bytes_per_token = LAYERS * 2 * (2 * 8 * 4)  # keys and values, 2 heads x 8 float32s
    for _ in range(REPROBE_AFTER):
        assert restore(cache, tokens) == (None, 0)
    caches, n = restore(cache, tokens)  # probed: the disk is fast now, so the run is restored
    assert n == 8 * B and cache.costs.ssd_rate.value > 1e3 and cache.costs.ssd_rate.skipped == 0
    cache.tiers.ssd.close()


def probe_while_idle(cache: PrefixCache) -> None:
    """What an idle engine does, loop after loop, until the timing is over."""
    cache.idle_probe.step()
    for _ in range(500):
        if cache.idle_probe.in_flight is None:
            return
        time.sleep(0.01)
        cache.idle_probe.step()
    pytest.fail("the idle timing never ended")


def test_an_idle_engine_times_the_ssd_so_the_first_request_does_not(tmp_path: Path) -> None:
    # a fresh cache directory's first restore would time a part of the run inside the request
    # (0.09 s of a first TTFT at 8B on an H200); the idle engine before it times it instead
    from omlx.cache.plan.restore_model import REPROBE_AFTER

    tokens = list(range(10, 10 + 8 * B + 1))
    stored(tmp_path, tokens)
    cache = open_cache(tmp_path)
    ssd = cache.tiers.ssd
    before, order = ssd.stats(), list(ssd._index)
    probe_while_idle(cache)
    assert cache.costs.ssd_rate.value is not None and cache.costs.bytes_per_token > 0
    after = ssd.stats()
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"]) and list(ssd._index) == order
    assert not any(cache.tiers.device.contains(k) for k in order)  # what it read was dropped
    cache.costs.prefill.observe(100, 0, 100.0)  # recomputing is slow: the whole run is restored
    fetched: list[int] = []
    real = ssd.get_many
    ssd.get_many = lambda keys, fp: fetched.append(len(keys)) or real(keys, fp)
    _, n = restore(cache, tokens)
    assert n == 8 * B and fetched == [8]  # in one go: no part of it timed first
    # judged slower too many times in a row, it is timed again while idle, not in a request
    cache.costs.ssd_rate.observe(1, 1e9)
    cache.costs.ssd_rate.skipped = REPROBE_AFTER
    probe_while_idle(cache)
    assert cache.costs.ssd_rate.skipped == 0 and cache.costs.ssd_rate.value > 1e3
    cache.tiers.ssd.close()




def test_an_idle_engine_does_not_time_an_ssd_without_its_blocks(tmp_path: Path, monkeypatch) -> None:
    stored(tmp_path, list(range(10, 10 + 4 * B)))
    other = PrefixCache(make_tiers(B, 1 << 30, ssd=tmp_path), "e" * 64, LAYERS, "other")
    ssd = other.tiers.ssd
    scans: list[int] = []
    real = ssd.recent_keys
    monkeypatch.setattr(ssd, "recent_keys", lambda fp, n: scans.append(n) or real(fp, n))
    for _ in range(3):  # idle loops: the index is looked through once, until it changes
        other.idle_probe.step()
    assert other.idle_probe.in_flight is None and other.costs.ssd_rate.value is None and len(scans) == 1
    ssd.close()


def test_unmeasured_ssd_restores_the_run_when_recompute_is_slow(tmp_path: Path) -> None:
    tokens = list(range(10, 10 + 8 * B + 1))
    stored(tmp_path, tokens)
    cache = open_cache(tmp_path)
    cache.costs.prefill.observe(100, 0, 100.0)  # one token per second
    caches, n = restore(cache, tokens)
    assert n == 8 * B
    assert cache.tiers.counters.skipped_restores == 0
    restored = mx.concatenate([c.state[0] for c in caches])
    assert restored.shape == (LAYERS, 2, 8 * B, 8)
    cache.close(timeout=1.0)  # as its engine stops: the newest measurements saved, not left to a thread
    cache.tiers.ssd.close()
    # and the measured rate is what the next process starts from
    again = open_cache(tmp_path)
    assert again.costs.ssd_rate.value == cache.costs.ssd_rate.value and again.costs.bytes_per_token == cache.costs.bytes_per_token
    again.tiers.ssd.close()


def test_a_restore_barely_faster_than_recomputing_recomputes(tmp_path: Path) -> None:
    # host-memory and disk restores vary more than prefills: within RESTORE_MARGIN of the
    # recompute estimate the run is recomputed, clearly faster it is restored
    tokens = list(range(10, 10 + 8 * B + 1))
    stored(tmp_path, tokens)
    for restore_s, expected in ((0.9, 0), (0.7, 8 * B)):
        cache = open_cache(tmp_path)
        cache.costs.bytes_per_token = LAYERS * 2 * (2 * 8 * 4)  # keys and values, 2 heads x 8 float32s
        cache.costs.prefill.observe(8 * B, 0, 1.0)  # recomputing the run: 1 s
        cache.costs.ssd_rate.observe(8 * B * cache.costs.bytes_per_token, restore_s)
        _, n = restore(cache, tokens)
        assert n == expected, restore_s
        assert cache.tiers.counters.skipped_restores == (expected == 0)
        cache.tiers.ssd.close()


def test_a_run_behind_a_cached_prefix_is_judged_against_recomputing_it_there(tmp_path: Path) -> None:
    # recomputing tokens behind 12 cached blocks costs their attention over those blocks too:
    # judged as if at the root, the same restore would look slower than recomputing
    tokens = list(range(10, 10 + 16 * B + 1))
    stored(tmp_path, tokens)
    cache = open_cache(tmp_path)
    _, n = restore(cache, tokens[: 12 * B + 1])  # nothing measured yet: restored
    assert n == 12 * B
    run = 4 * B
    cache.costs.prefill.observe(run, 0, 1.0)  # t = a·n + b·n·(d + n/2): 1 s at the root,
    cache.costs.prefill.observe(run, 12 * B, 4.0)  # 4 s behind the 12 blocks
    assert abs(cache.costs.prefill.seconds(run, 12 * B) - 4.0) < 1e-6
    cache.costs.ssd_rate.forget()
    cache.costs.ssd_rate.observe(run * cache.costs.bytes_per_token, 1.0)  # restoring the run: 1 s
    _, n = restore(cache, tokens)
    assert n == 16 * B  # 1 s against 4 (at the root it would have been 1 s against 1: recomputed)
    assert cache.tiers.counters.skipped_restores == 0
    cache.tiers.ssd.close()


def test_a_tail_the_engine_would_drop_is_not_fetched(tmp_path: Path) -> None:
    # on the engine's prefill grid (a CUDA GPU: whole blocks) a partial block is no use, so
    # `lookup` does not read it from the SSD (on the engine thread) only for it to be dropped
    tokens = list(range(10, 10 + 2 * B + 10))
    stored(tmp_path, tokens)
    for grid, expected, hot_blocks in ((0, 2 * B + 10, 3), (B, 2 * B, 2)):
        cache = open_cache(tmp_path)
        _, n = restore(cache, tokens + [7], grid=grid)
        assert (n, cache.tiers.device.stats()["blocks"]) == (expected, hot_blocks), grid
        cache.tiers.ssd.close()


def test_prefill_estimate_drops_fast_after_a_slow_first_prefill() -> None:
    from omlx.cache.plan.prefill_cost import PrefillCost

    cost = PrefillCost()
    cost.observe(8000, 0, 2.0)  # a GPU's first prefill of this shape: kernels compiling
    cost.observe(8000, 0, 0.17)  # the same prefill warm
    assert cost.seconds(8000) < 0.3  # not ~1 s: that would make a 0.37 s RAM restore look good
    cost.observe(8000, 0, 0.30)  # a slower one (a busy device) still counts with full weight
    assert 0.17 < cost.seconds(8000) < 0.3


def test_restore_rate_weighs_each_restore_by_its_size() -> None:
    from omlx.cache.plan.restore_model import Throughput

    rate = Throughput()
    rate.observe(2e6, 2e6 / 8e9)  # a one-block probe: 8 GB/s
    rate.observe(262e6, 0.37)  # the 8,000-token restore after it: 0.7 GB/s
    assert rate.value < 0.8e9  # the run decides, not the probe


def test_a_block_restored_from_ram_is_not_copied_back_when_hot_cannot_keep_it(monkeypatch) -> None:
    """A hot tier too small for a block hands it to RAM; if RAM still holds that block (it was
    just restored from there), it is only refreshed: no second device -> host copy."""
    from omlx.cache.block.block import HostBlock

    cache = PrefixCache(make_tiers(B, 1, ram_bytes=1 << 30), FP, LAYERS, "m")
    warm = cache.tiers.ram
    tokens = list(range(10, 10 + 4 * B + 1))
    cache.store(tokens, kv(len(tokens)), final=True)  # hot holds nothing: all blocks go to RAM
    assert warm.stats()["blocks"] == 5  # four full blocks and the partial tail
    copies = []
    original = HostBlock.of

    def counting(block, copy=False):  # counts device -> host copies, then makes them
        copies.append(block.key)
        return original(block, copy=copy)

    monkeypatch.setattr(HostBlock, "of", counting)
    cache.costs.prefill.observe(100, 0, 100.0)  # recompute is slow: restore from RAM
    caches, n = restore(cache, tokens)
    assert n == 4 * B and caches[0].offset == 4 * B
    assert copies == []  # restored blocks went back to the RAM tier that holds them: no copies
    assert warm.stats()["blocks"] == 5


def test_prompt_blocks_wait_for_the_end_when_only_ram_would_keep_them() -> None:
    """Stored right after the prefill, blocks that the hot tier cannot hold would be copied to
    RAM between the request's first and second token: they are stored when it finishes."""
    tokens = list(range(10, 10 + 4 * B + 1))
    ram_only = PrefixCache(make_tiers(B, 1, ram_bytes=1 << 30), FP, LAYERS, "m")
    roomy = PrefixCache(make_tiers(B, 1 << 30, ram_bytes=1 << 30), FP, LAYERS, "m")
    for cache in (ram_only, roomy):
        cache.store(tokens, kv(len(tokens)), final=True)  # the first store measures a block's bytes
    assert roomy.match(tokens).worth_storing(8 * B, 0)
    assert not ram_only.match(tokens).worth_storing(8 * B, 0)
    assert not roomy.match(tokens).worth_storing(B - 1, 0)  # less than a block computed: at the end anyway


def test_when_only_ram_keeps_blocks_a_finished_sequence_is_stored_a_piece_per_call(monkeypatch) -> None:
    """Copied to RAM all at once, a 32,000-token prompt of an 8B model held its engine 3-8 s on
    an H200 while a new request waited: the engine stores such a sequence a piece per idle loop."""

    cache = PrefixCache(make_tiers(B, 1, ram_bytes=1 << 30), FP, LAYERS, "m")
    warm = cache.tiers.ram
    first = list(range(10, 10 + B + 1))
    assert cache.store(first, kv(len(first)), final=True) == 0  # measures a block's bytes; whole
    monkeypatch.setattr("omlx.cache.saver.write_back.WRITE_BACK_CHUNK", 2 * B * cache.costs.bytes_per_token)  # 2 blocks
    tokens = list(range(500, 500 + 7 * B + 5))  # seven full blocks and a tail
    sequence = kv(len(tokens))
    assert cache.store(tokens, sequence, final=False) == 0  # a prompt's store is never split
    tokens2 = list(range(900, 900 + 7 * B + 5))
    sequence2 = kv(len(tokens2))
    starts, held = [cache.store(tokens2, sequence2, final=True)], [warm.stats()["blocks"]]
    while starts[-1]:
        starts.append(cache.store(tokens2, sequence2, final=True, start=starts[-1]))
        held.append(warm.stats()["blocks"])
    assert starts == [2 * B, 4 * B, 6 * B, 0]
    assert [h - held[0] for h in held] == [0, 2, 4, 6]  # two a call, root first; the last: the 7th and the tail
    cache.costs.prefill.observe(100, 0, 100.0)  # recomputing is slow: a lookup restores what RAM holds
    cache.costs.ram_move_rate.observe(1e9, 1.0)
    assert restore(cache, tokens2)[1] == len(tokens2) - 1  # the whole chain, up to its last token


def test_a_piecewise_store_ends_even_when_ram_cannot_hold_the_whole_sequence(monkeypatch) -> None:

    probe = PrefixCache(make_tiers(B, 1, ram_bytes=1 << 30), FP, LAYERS, "m")
    probe.store(list(range(10, 10 + B)), kv(B), final=True)
    block = B * probe.costs.bytes_per_token
    cache = PrefixCache(make_tiers(B, 1, ram_bytes=3 * block), FP, LAYERS, "m")  # three blocks: the later ones push out the first
    cache.store(list(range(10, 10 + B)), kv(B), final=True)
    monkeypatch.setattr("omlx.cache.saver.write_back.WRITE_BACK_CHUNK", block)  # a block per call
    tokens = list(range(500, 500 + 8 * B))
    sequence = kv(len(tokens))
    calls, start = 1, cache.store(tokens, sequence, final=True)
    while start and calls < 20:
        calls, start = calls + 1, cache.store(tokens, sequence, final=True, start=start)
    assert (start, calls) == (0, 8)  # each block once, not again after RAM let it go














def test_a_pending_store_stops_when_its_chain_is_gone(monkeypatch) -> None:

    store = make_tiers(B, 1, ram_bytes=1 << 30)
    warm = store.ram
    cache = PrefixCache(store, FP, LAYERS, "m")
    cache.store(list(range(10, 10 + B + 1)), kv(B + 1), final=True)
    monkeypatch.setattr("omlx.cache.saver.write_back.WRITE_BACK_CHUNK", B * cache.costs.bytes_per_token)  # a block per call
    tokens = list(range(500, 500 + 6 * B))
    sequence = kv(len(tokens))
    start = cache.store(tokens, sequence, final=True)
    assert start == B
    store.clear()  # e.g. DELETE /api/cache
    assert cache.store(tokens, sequence, final=True, start=start) == 0
    assert warm.stats()["blocks"] == 0  # no blocks hanging off a root that is gone


def test_stored_blocks_reach_the_ssd_when_the_engine_is_idle(tmp_path: Path, monkeypatch) -> None:
    """Handing a block to the SSD writer copies it to host memory on the engine thread (slow
    on a CUDA GPU): there a busy engine hands over none the hot tier holds, however many wait
    (they cost no device memory beyond the tier's), and every call hands over at most a chunk,
    so no step or arriving request waits for more than that. On a CPU too: there the copy is a view,
    but the writer's work on a small machine slowed the tokens right after a long prompt."""

    cache = open_cache(tmp_path)
    ssd = cache.tiers.ssd
    tokens = list(range(10, 10 + 8 * B + 1))
    cache.store(tokens, kv(len(tokens)), final=True)  # 8 full blocks + a 1-token tail
    block_bytes = 2 * LAYERS * 2 * B * 8 * 4
    assert cache.tiers.stats()["unwritten_blocks"] == 9
    monkeypatch.setattr("omlx.cache.saver.write_back.WRITE_BACK_CHUNK", 2 * block_bytes)
    for _ in range(5):
        cache.write_back.pacer.balance = 1.0  # time to spare: still nothing moves
        assert not cache.write_back.step(idle=False)
    assert ssd.flush(10) and ssd.stats()["writes"] == 0
    writes = []
    while cache.write_back.step(idle=True):  # idle: a chunk per call
        assert ssd.flush(10)
        writes.append(ssd.stats()["writes"])
    assert writes == [2, 4, 6, 8]
    assert ssd.flush(10) and ssd.stats()["writes"] == 9
    assert cache.tiers.stats()["unwritten_blocks"] == 0
    assert cache.tiers.stats()["device_to_host"]["handed"]["bytes"] == 8 * block_bytes + block_bytes // B
    again = list(range(700, 700 + 4 * B))
    cache.store(again, kv(len(again)), final=True)
    cache.write_back.pacer.balance = 1.0
    assert not cache.write_back.step(idle=False)  # busy: none
    while cache.write_back.step(idle=True):
        pass
    assert ssd.flush(10) and ssd.stats()["writes"] == 13

    # a block the hot tier dropped (a clear of that tier alone) before its write-back is found
    other = list(range(500, 500 + 2 * B + 1))
    cache.store(other, kv(len(other)), final=True)
    cache.tiers.device.clear()
    caches, n = restore(cache, other)
    assert n == 2 * B and caches[0].offset == 2 * B
    # a clear drops what waits: nothing stored before it is written afterwards
    cache.tiers.clear()
    assert not cache.write_back.step(idle=True)
    assert ssd.flush(10) and ssd.stats()["blocks"] == 0
    assert cache.tiers.stats()["unwritten_blocks"] == 0

    # shutdown: everything still waiting goes
    more = list(range(300, 300 + 4 * B))
    cache.store(more, kv(len(more)), final=True)
    cache.close(timeout=10)
    assert ssd.flush(10) and ssd.stats()["writes"] == 17
    assert cache.tiers.stats()["unwritten_blocks"] == 0
    ssd.close()


def counted_host_copies(monkeypatch) -> list[tuple[str, bool]]:
    """(key, copy) of every device -> host view or copy of a block, from here on."""
    from omlx.cache.block.block import HostBlock

    calls: list[tuple[str, bool]] = []
    original = HostBlock.of

    def counting(block, copy=False):
        calls.append((block.key, copy))
        return original(block, copy=copy)

    monkeypatch.setattr(HostBlock, "of", counting)
    return calls


def test_an_unwritten_block_the_hot_tier_lets_go_goes_to_the_ssd_as_the_ram_copy(tmp_path: Path, monkeypatch) -> None:
    """On a CUDA GPU stored blocks wait in device memory for an idle engine before the SSD
    gets them. One the hot tier evicts meanwhile must not stay there outside its budget, nor
    be copied out twice (once for RAM, once for the SSD): the SSD writer takes the RAM copy."""
    block_bytes = 2 * LAYERS * 2 * B * 8 * 4
    cache = PrefixCache(make_tiers(B, 3 * block_bytes, ram_bytes=1 << 30, ssd=tmp_path), FP, LAYERS, "m")
    warm, ssd = cache.tiers.ram, cache.tiers.ssd
    copies = counted_host_copies(monkeypatch)
    tokens = list(range(10, 10 + 8 * B + 1))
    cache.store(tokens, kv(len(tokens)), final=True)  # 9 blocks; the hot tier keeps the last 3
    assert cache.tiers.device.stats()["blocks"] == 3 and warm.stats()["blocks"] == 6
    assert cache.tiers.stats()["unwritten_blocks"] == 3
    assert cache.write_back.unwritten_bytes() == cache.tiers.device.stats()["bytes"]  # no device bytes outside the budget
    assert ssd.flush(10) and ssd.stats()["writes"] == 6  # the evicted six, from their RAM copies
    assert [copy for _, copy in copies] == [True] * 6
    assert not cache.write_back.step(idle=True)  # idle: the three left, viewed (not copied) for the writer
    assert ssd.flush(10) and ssd.stats()["writes"] == 9
    assert len(copies) == 9 and len({key for key, _ in copies}) == 9  # each block out of device memory once
    ssd.close()
    again = open_cache(tmp_path)  # what was written from RAM copies restores as stored
    again.costs.prefill.observe(100, 0, 100.0)
    caches, n = restore(again, tokens)
    assert n == 8 * B
    for layer, c in enumerate(kv(len(tokens))):
        assert mx.array_equal(caches[layer].state[0], c.keys[:, :, : 8 * B, :])
        assert mx.array_equal(caches[layer].state[1], c.values[:, :, : 8 * B, :])
    again.tiers.ssd.close()


def test_without_a_ram_tier_an_evicted_unwritten_block_goes_to_the_ssd_unless_it_is_full(
    tmp_path: Path, monkeypatch
) -> None:
    block_bytes = 2 * LAYERS * 2 * B * 8 * 4
    cache = PrefixCache(make_tiers(B, 2 * block_bytes, ssd=tmp_path), FP, LAYERS, "m")
    ssd = cache.tiers.ssd
    tokens = list(range(10, 10 + 4 * B))
    cache.store(tokens, kv(len(tokens)), final=True)
    assert ssd.flush(10) and ssd.stats()["writes"] == 2  # the two the hot tier let go
    assert cache.tiers.stats()["unwritten_blocks"] == 2
    # a writer without room: evicted blocks wait (still found) rather than be dropped
    monkeypatch.setattr(ssd, "has_room", lambda: False)
    more = list(range(300, 300 + 2 * B + 1))
    cache.store(more, kv(len(more)), final=True)
    assert cache.tiers.stats()["unwritten_blocks"] == 5 and ssd.stats()["dropped_writes"] == 0
    caches, n = restore(cache, more)  # its first block waits outside the hot tier
    assert n == 2 * B and caches[0].offset == 2 * B
    monkeypatch.undo()
    cache.close(timeout=10)
    assert ssd.flush(10) and ssd.stats()["writes"] == 7
    assert cache.tiers.stats()["unwritten_blocks"] == 0
    ssd.close()


def test_a_run_judged_slower_than_recompute_is_not_fetched_by_the_tail_search() -> None:
    """The token-level tail search must not fetch, one block at a time, what the decision
    has just left for recomputing (on an H200 it did: a 'skipped' RAM restore came back as a
    256-token tail, and the request was 0.2-0.3 s slower than a miss)."""
    block = 64  # a whole block is a tail long enough to be used on its own
    cache = PrefixCache(make_tiers(block, 1, ram_bytes=1 << 30), FP, LAYERS, "m")
    tokens = list(range(10, 10 + 6 * block + 1))
    cache.store(tokens, kv(len(tokens)), final=True)  # hot holds nothing: all blocks go to RAM
    cache.costs.prefill.observe(100_000, 0, 1e-6)  # recompute: 10^11 tokens/s
    cache.costs.ram_copy_rate.observe(1e6, 1.0)  # RAM: 1 MB/s (copied: the hot tier cannot keep the run)
    caches, n = restore(cache, tokens + [7, 7, 7])
    assert (caches, n) == (None, 0)
    assert cache.tiers.counters.skipped_restores == 1


def test_one_slow_prefill_barely_moves_the_estimate_but_a_lasting_slowdown_does() -> None:
    from omlx.cache.plan.prefill_cost import PrefillCost

    cost = PrefillCost()
    for _ in range(5):
        cost.observe(8000, 0, 0.12)
    cost.observe(8000, 0, 0.36)  # a new prompt shape's graphs being built
    assert cost.seconds(8000) < 0.12 * 1.25  # a fifth of its weight: the decisions hold
    cost.observe(8000, 0, 0.12)
    for _ in range(5):
        cost.observe(8000, 0, 0.36)  # the device really is slower now: from the second, in full
    assert cost.seconds(8000) > 0.25


def test_the_hot_tier_evicts_chains_from_their_ends() -> None:
    """Every lookup starts at a chain's first block, so under pressure a chain must lose its
    last blocks, not its first (with blocks refreshed root first, the LRU did the opposite and
    kept tails no lookup could reach)."""
    block_bytes = 2 * LAYERS * 2 * B * 8 * 4
    cache = PrefixCache(make_tiers(B, 3 * block_bytes), FP, LAYERS, "m")
    long_chain = list(range(10, 10 + 5 * B))
    cache.store(long_chain, kv(len(long_chain)), final=True)  # 5 blocks, room for 3
    _, n = restore(cache, long_chain + [1])
    assert n == 3 * B  # its first three
    other = list(range(300, 300 + 2 * B))
    cache.store(other, kv(len(other)), final=True)  # pushes out two blocks of the first chain
    _, n = restore(cache, other + [1])
    assert n == 2 * B
    _, n = restore(cache, long_chain + [1])
    assert n == B  # its first block is still there


def test_a_prefix_served_from_memory_stays_on_the_ssd(tmp_path: Path) -> None:
    """The SSD's budget drops its least recently used blocks; a prefix every request takes from
    the hot tier is in use, and must outlive one nobody asked for since."""
    block_bytes = 2 * LAYERS * 2 * B * 8 * 4
    cache = PrefixCache(make_tiers(B, 1 << 30, ssd=tmp_path, ssd_bytes=5 * block_bytes), FP, LAYERS, "m")
    ssd = cache.tiers.ssd
    chains = [list(range(base, base + 2 * B)) for base in (10, 300, 600)]

    def stored(tokens: list[int]) -> None:
        cache.store(tokens, kv(len(tokens)), final=True)
        while cache.write_back.step(idle=True):
            pass
        assert ssd.flush(10)

    stored(chains[0])  # used by every request below, from device memory
    stored(chains[1])  # never asked for again
    _, n = restore(cache, chains[0] + [1])
    assert n == 2 * B
    stored(chains[2])  # over the SSD's budget
    assert ssd.stats()["evictions"] >= 1
    first = block_keys(FP, chains[0], B)
    assert all(ssd.contains(k, FP) for k in first)
    assert not all(ssd.contains(k, FP) for k in block_keys(FP, chains[1], B))
    ssd.close()


def test_evicted_unwritten_blocks_without_a_ram_copy_are_written_by_their_own_engine(
    tmp_path: Path, monkeypatch
) -> None:
    """Another model's store may push this model's waiting blocks out of device memory; with
    no RAM copy to hand over, this model's engine copies them out on its next loop, busy or
    not. With a RAM copy, a block that waited for room goes to the SSD as that copy."""
    import threading

    block_bytes = 2 * LAYERS * 2 * B * 8 * 4
    store = make_tiers(B, 2 * block_bytes, ssd=tmp_path)
    ssd = store.ssd
    mine = PrefixCache(store, FP, LAYERS, "m")
    tokens = list(range(10, 10 + 2 * B))
    mine.store(tokens, kv(len(tokens)), final=True)
    other_model = list(range(300, 300 + 2 * B))
    worker = threading.Thread(  # the other model's engine thread makes its cache and stores
        target=lambda: PrefixCache(store, "e" * 64, LAYERS, "o").store(other_model, kv(2 * B), final=True)
    )
    worker.start()
    worker.join()
    assert ssd.flush(10) and ssd.stats()["writes"] == 0  # not copied out on that thread
    assert mine.tiers.stats()["unwritten_blocks"] == 4
    copies = counted_host_copies(monkeypatch)
    assert not mine.write_back.step(idle=False)  # busy, under the bound: still its two go
    assert ssd.flush(10) and ssd.stats()["writes"] == 2
    assert sorted(copies) == sorted((k, False) for k in block_keys(FP, tokens, B))
    ssd.close()


def test_a_block_that_waited_for_room_is_written_from_its_ram_copy(tmp_path: Path, monkeypatch) -> None:
    block_bytes = 2 * LAYERS * 2 * B * 8 * 4
    cache = PrefixCache(make_tiers(B, block_bytes, ram_bytes=1 << 30, ssd=tmp_path), FP, LAYERS, "m")
    warm, ssd = cache.tiers.ram, cache.tiers.ssd
    monkeypatch.setattr(ssd, "has_room", lambda: False)
    tokens = list(range(10, 10 + 3 * B))
    cache.store(tokens, kv(len(tokens)), final=True)  # two pushed out to RAM, kept waiting
    assert warm.stats()["blocks"] == 2 and cache.tiers.stats()["unwritten_blocks"] == 3
    monkeypatch.undo()
    copies = counted_host_copies(monkeypatch)
    while cache.write_back.step(idle=True):
        pass
    assert ssd.flush(10) and ssd.stats()["writes"] == 3
    assert len(copies) == 1  # only the block still in device memory is viewed; the others are RAM's
    ssd.close()


def test_an_ssd_run_is_read_ahead_and_restored_without_touching_the_disk(tmp_path: Path, monkeypatch) -> None:

    tokens = list(range(10, 10 + 8 * B + 1))
    stored(tmp_path, tokens)
    cache = open_cache(tmp_path)
    ssd = cache.tiers.ssd
    cache.costs.prefill.observe(100, 0, 100.0)  # recompute: 1 token/s
    cache.costs.ssd_rate.observe(1e6, 0.001)  # the SSD so far: 1 GB/s
    cache.costs.bytes_per_token = 2 * LAYERS * 2 * 8 * 4
    monkeypatch.setattr("omlx.cache.plan.planner.AHEAD_MIN_BYTES", 1)
    keys = block_keys(FP, tokens, B)
    _, n = restore(cache, tokens[: B + 1])  # the first block restored in line: it is in device memory now
    assert n == B
    real_load = SSDTier._load

    def slow_load(self, *args):  # a slow disk, 0.2 s a block, on the reader threads
        time.sleep(0.2)
        return real_load(self, *args)

    monkeypatch.setattr(SSDTier, "_load", slow_load)
    done = threading.Event()
    hits = ssd.stats()["hits"]
    pending = read_ahead(cache, tokens, done.set)
    assert pending is not None and pending.plan.run_in(Tier.SSD).keys == tuple(keys[1:8]) and done.wait(10)
    cache.tiers.device.clear()  # meanwhile the first block left device memory
    read_in_line: list[list[str]] = []
    real_get_many = ssd.get_many

    def counting(run, fp):
        read_in_line.append(list(run))
        return real_get_many(run, fp)

    monkeypatch.setattr(ssd, "get_many", counting)
    caches, n = cache.cache_for(pending)
    assert n == 8 * B
    assert read_in_line == [keys[:1]]  # only the block that was not read ahead
    assert ssd.stats()["hits"] == hits + 8  # reads ahead count as hits, as those in line do
    for layer, c in enumerate(kv(len(tokens))):
        assert mx.array_equal(caches[layer].state[0], c.keys[:, :, : 8 * B, :])
    # the read-ahead's time (7 blocks of 0.2 s on 4 threads: >= 0.4 s) counts as restore time
    assert cache.costs.ssd_rate.value < 1e8
    assert read_ahead(cache, list(range(900, 900 + 4 * B)), done.set) is None  # nothing on the SSD
    ssd.close()


def test_an_admission_hashes_its_prompt_once_and_the_plan_carries_its_keys(tmp_path: Path, monkeypatch) -> None:
    # `match` hashes a prompt's blocks once per admission; the loader takes the keys from the plan
    # (no state kept between calls: before, a read-ahead left its keys for a lookup of the same list)
    from omlx.cache.plan import planner

    tokens = list(range(10, 10 + 4 * B + 1))
    stored(tmp_path, tokens)
    cache = open_cache(tmp_path)
    cache.costs.bytes_per_token = 2 * LAYERS * 2 * 8 * 4  # measured: the plan looks at the tiers
    hashed: list[list[int]] = []
    real = planner.block_keys
    monkeypatch.setattr(planner, "block_keys", lambda fp, ids, b, extra=None: hashed.append(ids) or real(fp, ids, b, extra))
    plan = cache.match(tokens)
    _, n = cache.cache_for(cache.load(plan))
    assert n == 4 * B and hashed == [tokens] and plan.keys == tuple(block_keys(FP, tokens, B))

def test_reads_ahead_do_not_hold_up_reads_in_line(tmp_path: Path, monkeypatch) -> None:
    slow = list(range(10, 10 + 8 * B))
    quick = list(range(300, 300 + 2 * B))
    stored(tmp_path, slow + quick)  # one chain: 10 blocks
    ssd = SSDTier(tmp_path, 1 << 30)
    assert ssd.wait_ready(10)
    slow_keys, quick_keys = block_keys(FP, slow + quick, B)[:8], block_keys(FP, slow + quick, B)[8:]
    real_load = SSDTier._load

    def slow_load(self, path, key, fp, part):
        if key in slow_keys:
            time.sleep(0.5)
        return real_load(self, path, key, fp, part)

    loads: list[str] = []

    def counted_slow_load(self, path, key, fp, part):
        loads.append(key)
        return slow_load(self, path, key, fp, part)

    monkeypatch.setattr(SSDTier, "_load", counted_slow_load)
    ahead = ssd.read_ahead(slow_keys, FP)  # 2 s of reads on 4 threads
    tic = time.perf_counter()
    got = ssd.get_many(quick_keys, FP)
    assert time.perf_counter() - tic < 0.4 and all(b is not None for b in got)
    again = ssd.read_ahead(slow_keys[4:], FP)  # another request with the same prefix, meanwhile
    assert again == ahead[4:]  # the reads in flight, not new ones
    assert all(f.result(10).block is not None for f in ahead)
    assert sorted(k for k in loads if k in slow_keys) == sorted(slow_keys)  # each read once
    ssd.close()




def prompt_in_ram() -> tuple[Tiers, PrefixCache, list[int]]:
    """A stored prompt of 8 blocks (and its tail) all in RAM, device memory empty with room."""
    store = make_tiers(B, 1 << 30, ram_bytes=1 << 30)
    cache = PrefixCache(store, FP, LAYERS, "m")
    tokens = list(range(10, 10 + 8 * B + 1))
    cache.store(tokens, kv(len(tokens)), final=True)
    store.device.set_max_bytes(0)  # everything goes to RAM...
    store.device.set_max_bytes(1 << 30)  # ...and device memory has room again
    return store, cache, tokens


def test_a_ram_run_moves_to_device_memory_a_chunk_per_engine_loop(monkeypatch) -> None:
    """Restoring from RAM copies host -> device (~2 GB/s through MLX on CUDA): done in `lookup`
    at once, every stream waits for all of it; `advance` moves a bounded chunk per loop."""

    block_bytes = 2 * LAYERS * 2 * B * 8 * 4
    store, cache, tokens = prompt_in_ram()
    assert store.ram.stats()["blocks"] == 9 and store.device.stats()["blocks"] == 0
    cache.costs.prefill.observe(100, 0, 100.0)  # recompute: 1 token/s
    cache.costs.ram_move_rate.observe(1e9, 1.0)
    monkeypatch.setattr("omlx.cache.plan.planner.AHEAD_MIN_BYTES", 1)
    monkeypatch.setattr("omlx.cache.loader.loader.MOVE_CHUNK", 2 * block_bytes)
    pending = read_ahead(cache, tokens)
    assert pending is not None and pending.needs_engine and not pending.reads
    in_device = []
    while not cache.advance(pending, move=True):
        in_device.append(store.device.stats()["blocks"])
    in_device.append(store.device.stats()["blocks"])
    assert in_device == [2, 4, 6, 8]  # two blocks a loop
    assert cache.advance(pending, move=False)  # ready stays ready

    def no_ram(*_a, **_k):
        raise AssertionError("lookup copied from RAM")

    monkeypatch.setattr(cache.loader.reads, "from_ram", no_ram)
    caches, n = cache.cache_for(pending)
    assert n == 8 * B
    for layer, c in enumerate(kv(len(tokens))):
        assert mx.array_equal(caches[layer].state[0], c.keys[:, :, : 8 * B, :])
    # the root ends most recently used: a squeeze takes the chain's end first
    store.device.set_max_bytes(3 * block_bytes)
    monkeypatch.undo()
    assert restore(cache, tokens[: 3 * B + 1])[1] == 3 * B


@pytest.mark.parametrize("recompute_per_token", [1.0, 1e-9])
def test_each_restore_decision_of_an_admission_is_logged_once(
    recompute_per_token: float, monkeypatch, caplog: pytest.LogCaptureFixture
) -> None:
    # the plan judges the RAM run once: one debug line per decision carried out, whether the
    # run is moved ahead (recomputing is slow) or left for recomputing (fast)
    import logging

    store, cache, tokens = prompt_in_ram()
    cache.costs.prefill.observe(1000, 0, 1000 * recompute_per_token)
    cache.costs.ram_move_rate.observe(1e9, 1.0)
    monkeypatch.setattr("omlx.cache.plan.planner.AHEAD_MIN_BYTES", 1)
    with caplog.at_level(logging.DEBUG, logger="omlx.cache"):
        loading = cache.load(cache.match(tokens))
        while loading.pending and not cache.advance(loading, move=True):
            pass
        _, n = cache.cache_for(loading)
    decisions = [r.getMessage() for r in caplog.records if "vs recompute" in r.getMessage()]
    moved_ahead = recompute_per_token == 1.0
    assert loading.plan.ahead == moved_ahead and n == (8 * B if moved_ahead else 0)
    assert len(decisions) == 1, decisions
    assert (": restore (" in decisions[0]) == moved_ahead, decisions




def ram_only_cache(hot_bytes: int, monkeypatch) -> tuple[PrefixCache, list[int]]:
    """A cache whose 8-block chain (plus a 1-token tail) sits in RAM only, rates measured."""

    store = make_tiers(B, 1 << 30, ram_bytes=1 << 30)
    cache = PrefixCache(store, FP, LAYERS, "m")
    tokens = list(range(10, 10 + 8 * B + 1))
    cache.store(tokens, kv(len(tokens)), final=True)
    store.device.set_max_bytes(0)
    store.device.set_max_bytes(hot_bytes)
    cache.costs.prefill.observe(100, 0, 100.0)
    cache.costs.ram_move_rate.observe(1e9, 1.0)
    monkeypatch.setattr("omlx.cache.plan.planner.AHEAD_MIN_BYTES", 1)
    return cache, tokens


def test_a_recomputed_prefix_that_ram_holds_is_made_again_only_if_the_hot_tier_can_hold_it(monkeypatch) -> None:
    """Recomputed (the decision judged RAM slower), a prefix's blocks are stored again: into
    a hot tier that can hold them; not when it cannot, where each would be made (a device
    copy per layer, on the engine thread before the next request) only to go back to RAM."""
    for hot_bytes, remade in ((1, 0), (1 << 30, 5)):
        cache = PrefixCache(make_tiers(B, hot_bytes, ram_bytes=1 << 30), FP, LAYERS, "m")
        warm = cache.tiers.ram
        tokens = list(range(10, 10 + 4 * B + 1))
        cache.store(tokens, kv(len(tokens)), final=True)
        cache.tiers.device.set_max_bytes(0)  # all let go to RAM: RAM alone holds the prefix
        cache.tiers.device.set_max_bytes(hot_bytes)
        made: list[str] = []
        real = BlockCutter.block
        monkeypatch.setattr(BlockCutter, "block", lambda self, *a, made=made, real=real: made.append(a[0]) or real(self, *a))
        cache.store(tokens, kv(len(tokens)), final=True)  # the same prefix, recomputed
        assert len(made) == remade
        assert warm.stats()["blocks"] == 5
        assert cache.tiers.device.stats()["blocks"] == remade


def test_requests_sharing_a_prefix_move_it_from_ram_once(monkeypatch) -> None:
    cache, tokens = ram_only_cache(1 << 30, monkeypatch)
    first, second = read_ahead(cache, tokens), read_ahead(cache, tokens, lambda: None)
    assert first is not None and second is not None
    while not cache.advance(first, move=True):
        pass
    copies = []
    real = cache.loader.reads.from_ram
    monkeypatch.setattr(cache.loader.reads, "from_ram", lambda key, move: copies.append(key) or real(key, move))
    assert cache.advance(second, move=True) and copies == []  # the first one moved them all
    assert read_ahead(cache, tokens, lambda: None) is None  # in device memory now: nothing to do


def test_a_ram_run_larger_than_half_the_hot_tier_moves_only_its_start(monkeypatch) -> None:
    block_bytes = 2 * LAYERS * 2 * B * 8 * 4
    cache, tokens = ram_only_cache(6 * block_bytes, monkeypatch)
    pending = read_ahead(cache, tokens)
    assert pending is not None and pending.to_move == block_keys(FP, tokens, B)[:3]
    while not cache.advance(pending, move=True):
        pass
    caches, n = cache.cache_for(pending)  # the other five come from RAM here
    assert n == 8 * B and caches[0].offset == 8 * B


def test_a_run_restored_from_ram_moves_into_the_hot_tier_as_it_lies_in_ram(monkeypatch) -> None:
    """RAM keeps a block as one MLX array made from host bytes; a restore that the hot tier
    can keep moves it there as it is (on a CUDA GPU its pages migrate at first use: 6.7 GB/s
    on an H200, against 1.7 GB/s for a new array from host bytes), and RAM lets it go. When
    the hot tier lets it go again it is copied out again."""
    cache, tokens = ram_only_cache(1 << 30, monkeypatch)
    warm, hot = cache.tiers.ram, cache.tiers.device
    keys = block_keys(FP, tokens, B)[:8]
    staged = {key: warm.peek(key).staged for key in keys}
    made = []
    real = mx.array
    with monkeypatch.context() as m:
        m.setattr(mx, "array", lambda *a, **k: made.append(1) or real(*a, **k))
        caches, n = restore(cache, tokens)
    assert n == 8 * B and made == []  # no array made from host bytes
    assert not any(map(warm.contains, keys)) and all(map(hot.contains, keys))
    first = hot.peek(keys[0]).tensors[KV_STACK]
    before = float(first[0, 0, 0, 0].item())
    np.asarray(staged[keys[0]])[3] ^= 0x80  # the first float32's sign bit: RAM's bytes are the hot block's
    assert float(first[0, 0, 0, 0].item()) == -before
    copies = counted_host_copies(monkeypatch)
    hot.set_max_bytes(0)  # let go again: copied out again, into new staged arrays
    assert sorted(k for k, _ in copies) == sorted(keys) and all(map(warm.contains, keys))
    assert all(warm.peek(key).staged is not staged[key] for key in keys)


def test_a_ram_block_the_ssd_writer_has_yet_to_read_is_copied_not_moved(tmp_path: Path) -> None:
    # moved, its pages would go to the device and the writer's reads would pull them back
    cache = PrefixCache(make_tiers(B, 1 << 30, ram_bytes=1 << 30, ssd=tmp_path), FP, LAYERS, "m")
    warm, ssd = cache.tiers.ram, cache.tiers.ssd
    tokens = list(range(10, 10 + 2 * B + 1))
    cache.hold_writes(True)  # the writer waits (as during a lone prefill)
    cache.store(tokens, kv(len(tokens)), final=True)
    cache.tiers.device.set_max_bytes(0)  # pushed out: to RAM, and to the writer as RAM's copy
    cache.tiers.device.set_max_bytes(1 << 30)
    keys = block_keys(FP, tokens, B)[:2]
    assert all(map(ssd.writing, keys)) and all(map(warm.contains, keys))
    cache.costs.prefill.observe(100, 0, 100.0)
    cache.costs.ram_move_rate.observe(1e9, 1.0)
    caches, n = restore(cache, tokens)
    assert n == 2 * B and all(map(warm.contains, keys))  # copies: RAM keeps them for the writer
    cache.hold_writes(False)
    assert ssd.flush(10) and not any(map(ssd.writing, keys))
    ssd.close()


def test_a_ram_run_the_hot_tier_cannot_keep_is_copied_and_ram_keeps_it(monkeypatch) -> None:
    block_bytes = 2 * LAYERS * 2 * B * 8 * 4
    cache, tokens = ram_only_cache(3 * block_bytes, monkeypatch)
    copies = counted_host_copies(monkeypatch)
    caches, n = restore(cache, tokens)
    keys = block_keys(FP, tokens, B)[:8]
    assert n == 8 * B and all(map(cache.tiers.ram.contains, keys))
    assert copies == []  # the copies the hot tier let go were RAM's: not copied out again
    assert mx.array_equal(caches[1].state[1], kv(len(tokens))[1].state[1][..., : 8 * B, :])


BLOCK_BYTES = LAYERS * 2 * (2 * B * 8 * 4)  # keys and values of `kv`: 2 heads x 8 float32s a token


def demoting(bound: int, *fingerprints: str) -> tuple[Tiers, list[PrefixCache]]:
    """A hot tier of two blocks, a RAM tier, evicted blocks waiting up to `bound` bytes."""
    store = make_tiers(B, 2 * BLOCK_BYTES, ram_bytes=1 << 30, demote_bound=bound)
    return store, [PrefixCache(store, fp, LAYERS, "m") for fp in fingerprints or (FP,)]


def test_blocks_a_restore_pushes_out_wait_for_the_idle_engine_beyond_the_bound(monkeypatch) -> None:
    # moving a prompt back from RAM into a full hot tier pushes out as much: copied out on the
    # spot beyond the bound (1.4 GB/s on an H200), a 4.2 GB restore ran at 1.3 GB/s, not ~7
    store, (cache,) = demoting(1)  # evictions wait for no one, except a restore's
    cache.costs.prefill.observe(100, 0, 100.0)
    cache.costs.ram_move_rate.observe(1e9, 1.0)
    a, b = list(range(10, 10 + 2 * B + 1)), list(range(500, 500 + 2 * B + 1))
    cache.store(a, kv(len(a)), final=True)
    copies = counted_host_copies(monkeypatch)
    # a's blocks pushed out wait as far as the stores' allowance goes (the hot tier's size): one
    # of a's blocks is copied at once, the other and both tails (a's, then b's) wait
    cache.store(b, kv(len(b)), final=True)
    tail = BLOCK_BYTES // B
    assert len(copies) == 1 and store.stats()["demoting_bytes"] == BLOCK_BYTES + 2 * tail
    while cache.write_back.step(idle=True):  # the idle engine copies them
        pass
    assert len(copies) == 4 and store.stats()["demoting_bytes"] == 0 and store.demotion._moved_in == 0
    caches, n = restore(cache, a)  # a comes back from RAM, b's blocks make room
    assert n == 2 * B and len(copies) == 4 and store.stats()["demoting_bytes"] == 2 * BLOCK_BYTES
    assert mx.array_equal(caches[0].state[0], kv(len(a))[0].state[0][..., : 2 * B, :])
    for _ in range(4):  # a busy engine: what passes half of what may wait goes, and the allowance with it
        cache.write_back.step(idle=False)
    assert len(copies) == 6 and store.stats()["demoting_bytes"] == 0 and store.demotion._moved_in == 0
    assert all(store.ram.contains(k) for k in block_keys(FP, b, B)[:2])


def test_a_prefetch_moving_a_block_per_loop_lets_what_it_pushes_out_wait_too(monkeypatch) -> None:
    # the allowance is the restore's, not one chunk's: at 8B, a prefetch past the bound copied
    # out on the spot and moved 2.5 GB at ~1.5 GB/s

    store = make_tiers(B, 4 * BLOCK_BYTES, ram_bytes=1 << 30, demote_bound=1)
    cache = PrefixCache(store, FP, LAYERS, "m")
    cache.costs.prefill.observe(100, 0, 100.0)
    cache.costs.ram_move_rate.observe(1e9, 1.0)
    monkeypatch.setattr("omlx.cache.plan.planner.AHEAD_MIN_BYTES", 1)
    monkeypatch.setattr("omlx.cache.loader.loader.MOVE_CHUNK", 1)  # a block per loop
    a, b = list(range(10, 10 + 2 * B)), list(range(500, 500 + 4 * B))
    cache.store(a, kv(len(a)), final=True)
    copies = counted_host_copies(monkeypatch)
    cache.store(b, kv(len(b)), final=True)  # a pushed out: waits (the store's allowance)
    assert copies == [] and store.stats()["demoting_bytes"] == 2 * BLOCK_BYTES
    while cache.write_back.step(idle=True):  # then the idle engine copies it to RAM
        pass
    assert len(copies) == 2 and store.stats()["demoting_bytes"] == 0
    pending = read_ahead(cache, a + [1], lambda: None)
    assert pending is not None and len(pending.to_move) == 2
    assert not cache.advance(pending, move=True) and cache.advance(pending, move=True)
    assert len(copies) == 2 and store.stats()["demoting_bytes"] == 2 * BLOCK_BYTES  # b's two wait
    assert cache.cache_for(pending)[1] == 2 * B
    while cache.write_back.step(idle=True):
        pass
    assert len(copies) == 4 and store.stats()["demoting_bytes"] == 0


def test_blocks_the_hot_tier_lets_go_reach_ram_from_their_own_engine_when_it_is_idle(monkeypatch) -> None:
    # copied at eviction, the device -> host copy held up the engine that stored (and every
    # request behind it); now it waits in device memory for an idle loop, a chunk at a time

    store, (cache,) = demoting(1 << 20)
    copies = counted_host_copies(monkeypatch)
    tokens = list(range(10, 10 + 6 * B))
    cache.store(tokens, kv(len(tokens)), final=True)
    assert copies == [] and store.stats()["demoting_bytes"] == 4 * BLOCK_BYTES  # 4 of 6 let go
    assert cache.write_back.step(idle=False) and copies == []  # a busy engine: not yet
    monkeypatch.setattr("omlx.cache.saver.write_back.WRITE_BACK_CHUNK", BLOCK_BYTES)
    assert cache.write_back.step(idle=True) and len(copies) == 1 and store.ram.stats()["blocks"] == 1
    caches, n = restore(cache, tokens)  # wanted again: taken back from device memory, not copied
    assert n == 6 * B - 1 and len(copies) == 1  # all but the last token
    assert mx.array_equal(caches[0].state[0][..., :n, :], kv(len(tokens))[0].state[0][..., :n, :])
    while cache.write_back.step(idle=True):
        pass
    assert store.stats()["demoting_bytes"] == 0 and store.directory.is_demoting(block_keys(FP, tokens, B)[0]) is False


def test_past_the_bound_a_block_the_hot_tier_lets_go_is_copied_at_once(monkeypatch) -> None:
    store, (cache,) = demoting(BLOCK_BYTES)
    copies = counted_host_copies(monkeypatch)
    tokens = list(range(10, 10 + 6 * B))
    cache.store(tokens, kv(len(tokens)), final=True)
    # 4 let go: the bound (a block) and the store's allowance (the hot tier's size, 2 blocks) let
    # 3 wait; the one past them is copied at once
    assert len(copies) == 1 and store.stats()["demoting_bytes"] == 3 * BLOCK_BYTES
    assert cache.write_back.step(idle=False)  # busy: while they fill over half of what may wait, they go
    assert len(copies) == 3 and store.stats()["demoting_bytes"] == BLOCK_BYTES
    while cache.write_back.step(idle=True):
        pass
    assert len(copies) == 4 and store.stats()["demoting_bytes"] == 0 and store.demotion._moved_in == 0


def test_a_busy_engine_copies_blocks_out_within_its_share_of_time(monkeypatch) -> None:
    # each copy out holds up every stream: after a long prompt's store pushed 15 GB out of an
    # H200's hot tier, copying a block per step slowed decode from ~80 to 2-20 tok/s
    store, (cache,) = demoting(BLOCK_BYTES)
    now = [0.0]

    def clock() -> float:  # 10 ms pass between any two readings: each copy takes 10 ms
        now[0] += 0.01
        return now[0]

    cache.write_back.pacer = CopyPacer(share=0.1, burst=0.02, clock=clock)
    monkeypatch.setattr("omlx.cache.saver.write_back.WRITE_BACK_CHUNK", BLOCK_BYTES)  # a block per loop, as at 8B
    copies = counted_host_copies(monkeypatch)
    tokens = list(range(10, 10 + 6 * B))
    cache.store(tokens, kv(len(tokens)), final=True)
    assert len(copies) == 1 and store.stats()["demoting_bytes"] == 3 * BLOCK_BYTES  # as above
    assert cache.write_back.step(idle=False) and len(copies) == 2  # nothing spent yet: one copy
    assert cache.write_back.pacer.balance == pytest.approx(-0.01)  # its 10 ms
    assert cache.write_back.step(idle=False) is False and len(copies) == 2  # 30 ms later: 3 ms earned back
    now[0] += 1.0  # a second later the balance is at most the burst: one copy
    assert cache.write_back.step(idle=False) and len(copies) == 3
    moved = store.stats()["device_to_host"]
    assert moved["demoted"]["bytes"] == 2 * BLOCK_BYTES and moved["evicted"]["bytes"] == BLOCK_BYTES
    cache.write_back.pacer.balance = -1.0
    while cache.write_back.step(idle=True):  # idle: not paced
        pass
    assert len(copies) == 4 and store.stats()["demoting_bytes"] == 0


def test_memory_the_hot_tier_yields_leaves_the_device_at_once(monkeypatch) -> None:
    # shed blocks waiting in device memory for their RAM copy would free nothing for the
    # sequences that asked for the room
    store, (cache,) = demoting(1 << 30)
    tokens = list(range(10, 10 + 2 * B))
    cache.store(tokens, kv(len(tokens)), final=True)
    copies = counted_host_copies(monkeypatch)
    assert cache.yield_memory(BLOCK_BYTES) == BLOCK_BYTES
    assert len(copies) == 1 and store.stats()["demoting_bytes"] == 0
    assert store.ram.contains(block_keys(FP, tokens, B)[1])  # the deepest went first
    more = list(range(500, 500 + 3 * B))
    cache.store(more, kv(len(more)), final=True)  # 2 blocks pushed out wait for their copy
    assert store.stats()["demoting_bytes"] == 2 * BLOCK_BYTES and store.device.stats()["blocks"] == 2
    assert cache.yield_memory(BLOCK_BYTES) == BLOCK_BYTES  # a waiting block goes first
    assert len(copies) == 2 and store.stats()["demoting_bytes"] == BLOCK_BYTES and store.device.stats()["blocks"] == 2


def test_each_engine_copies_only_its_own_evicted_blocks_and_all_of_them_at_unload(monkeypatch) -> None:
    # another model's arrays are best read on its own engine's thread
    store, (mine, theirs) = demoting(1 << 20, FP, "e" * 64)
    copies = counted_host_copies(monkeypatch)
    their_tokens = list(range(500, 500 + 2 * B))
    theirs.store(their_tokens, kv(len(their_tokens)), final=True)
    tokens = list(range(10, 10 + 2 * B))
    mine.store(tokens, kv(len(tokens)), final=True)  # pushes their two blocks out
    assert store.stats()["demoting_bytes"] == 2 * BLOCK_BYTES
    assert not mine.write_back.step(idle=True) and copies == []
    theirs.close(timeout=1.0)  # an unload: what waits goes to RAM now
    assert len(copies) == 2 and store.stats()["demoting_bytes"] == 0
    assert {k for k, _ in copies} == set(block_keys("e" * 64, their_tokens, B))
    store.clear()


def test_a_block_waiting_for_both_the_ssd_and_ram_is_copied_out_once(tmp_path: Path, monkeypatch) -> None:
    import collections


    store = make_tiers(B, 2 * BLOCK_BYTES, ram_bytes=1 << 30, demote_bound=1 << 20, ssd=tmp_path)
    ssd = store.ssd
    cache = PrefixCache(store, FP, LAYERS, "m")
    monkeypatch.setattr("omlx.cache.saver.write_back.WRITE_BACK_CHUNK", BLOCK_BYTES)
    copies = counted_host_copies(monkeypatch)
    tokens = list(range(10, 10 + 6 * B))
    cache.store(tokens, kv(len(tokens)), final=True)
    _, n = restore(cache, tokens)  # takes the let-go blocks back, lets others go again
    assert n == 6 * B - 1

    def consistent() -> bool:
        return store.stats()["demoting_bytes"] == sum(b.nbytes for b in store.directory.demoting_blocks())

    assert consistent()
    while cache.write_back.step(idle=True):
        assert consistent()
    assert store.stats()["demoting_bytes"] == 0 and store.stats()["unwritten_blocks"] == 0
    copied = collections.Counter(key for key, copy in copies if copy)
    assert copied and max(copied.values()) == 1  # RAM and the SSD share one copy
    ssd.close()


def test_no_block_waits_for_ram_when_the_hot_tier_holds_none() -> None:
    # a hot tier of 0 bytes (or smaller than a block) must not become a device cache of its own
    assert make_tiers(B, 0, ram_bytes=1 << 30, demote_bound=1 << 20).demote_bound == 0
    store, (cache,) = demoting(1 << 20)
    store.device.set_max_bytes(BLOCK_BYTES // 2)
    tokens = list(range(10, 10 + 2 * B))
    cache.store(tokens, kv(len(tokens)), final=True)
    assert store.stats()["demoting_bytes"] == 0 and store.ram.stats()["blocks"] >= 2


def test_a_reloaded_model_keeps_demoting_while_its_old_engine_closes(monkeypatch) -> None:
    store, (old,) = demoting(1 << 20)
    new = PrefixCache(store, FP, LAYERS, "m")  # the reload, before the old engine's close
    copies = counted_host_copies(monkeypatch)
    tokens = list(range(10, 10 + 4 * B))
    new.store(tokens, kv(len(tokens)), final=True)
    old.close(timeout=1.0)
    assert copies == [] and store.stats()["demoting_bytes"] == 2 * BLOCK_BYTES  # the new engine's to copy
    while new.write_back.step(idle=True):
        pass
    assert len(copies) == 2 and store.stats()["demoting_bytes"] == 0


def test_an_idle_engine_fits_the_prefill_model_before_the_next_decision(tmp_path: Path, monkeypatch) -> None:
    # the fit of the latest prefills is made while idle, not in the next request's restore
    # decision or when its prefill is observed (the model's prediction of it), both of which
    # add to that request's time to first token
    from omlx.cache.plan import prefill_cost

    cache = open_cache(tmp_path)
    fits: list[int] = []
    real = prefill_cost.PrefillCost._fit_sums
    monkeypatch.setattr(prefill_cost.PrefillCost, "_fit_sums", lambda self: fits.append(1) or real(self))
    cache.observe_prefill(1000, 0, 0.5)
    cache.observe_prefill(200, 1000, 0.2)
    fits.clear()
    probe_while_idle(cache)
    assert len(fits) == 1
    assert cache.match(list(range(600))).recompute_seconds(500, 0) is not None  # the next request's decision
    cache.observe_prefill(500, 0, 0.25)  # ...and its prefill
    assert len(fits) == 1
    cache.tiers.ssd.close()


def test_a_prompt_longer_than_the_hot_tier_keeps_its_first_blocks_there(tmp_path: Path) -> None:
    """A prompt stored as its prefill goes (two pieces), then again with its answer, holds
    four times what the hot tier does: the hot tier keeps the chain's first blocks (a chain
    without its root serves no lookup) and sends the deepest to the SSD, so the next lookup
    finds the hot run at once and, once the SSD has written the rest, the whole prompt."""
    block_bytes = LAYERS * 2 * 2 * B * 8 * 4  # kv(): float32 (1, 2, T, 8) keys and values per layer
    cache = PrefixCache(make_tiers(B, 8 * block_bytes, ssd=tmp_path), FP, LAYERS, "m")
    ssd = cache.tiers.ssd
    tokens = list(range(1, 32 * B + 1))
    whole = kv(len(tokens) + 5)
    cache.hold_writes(True)  # as while a prompt prefills alone: the SSD writes wait
    cache.store(tokens[: 16 * B], whole, final=False)
    cache.store(tokens, whole, final=False)
    cache.store(tokens + [7] * 5, whole, final=True)
    keys = block_keys(FP, tokens, B)
    assert [cache.tiers.device.contains(k) for k in keys] == [True] * 8 + [False] * 24
    _, n = restore(cache, tokens + [9])
    assert n == 8 * B  # the hot run; the rest still waits for the SSD writer
    cache.hold_writes(False)
    assert ssd.flush(10)
    _, n = restore(cache, tokens + [9])
    assert n == len(tokens)
    assert all(cache.tiers.device.contains(k) for k in keys[:8])  # the restore pushed out none of them
    ssd.close()


def test_past_the_bound_a_block_leaving_device_memory_goes_to_ram_though_the_ssd_holds_it(
    tmp_path: Path, monkeypatch
) -> None:
    # letting such blocks go uncopied because the SSD held them lost them once the SSD's smaller
    # budget evicted their files: a 120k-token float32 prompt whose KV outgrew the hot tier was
    # then restored to less than half (docs/design/long-context.md)
    store = make_tiers(B, 2 * BLOCK_BYTES, ram_bytes=1 << 30, demote_bound=BLOCK_BYTES, ssd=tmp_path)
    ssd = store.ssd
    cache = PrefixCache(store, FP, LAYERS, "m")
    earlier = list(range(10, 10 + 2 * B))
    cache.store(earlier, kv(len(earlier)), final=True)
    while cache.write_back.step(idle=True):
        pass
    assert ssd.flush(10) and all(ssd.contains(k, FP) for k in block_keys(FP, earlier, B))
    copies = counted_host_copies(monkeypatch)
    monkeypatch.setattr(store.demotion, "_allowed", lambda: 0)  # what may wait is taken (by earlier stores)
    tokens = list(range(500, 500 + 6 * B))
    cache.store(tokens, kv(len(tokens)), final=True)  # pushes out both earlier blocks and 4 of its own
    copied = {key for key, copy in copies if copy}
    assert set(block_keys(FP, earlier, B)) <= copied  # on the SSD, and copied to RAM all the same
    assert all(store.ram.contains(k) for k in block_keys(FP, earlier, B))
    assert store.stats()["demoting_bytes"] == 0
    ssd.clear()  # the SSD's budget lets the files go
    caches, n = restore(cache, earlier + [1])  # still served, from RAM
    assert n == 2 * B
    assert mx.array_equal(caches[0].state[0], kv(len(earlier))[0].state[0][..., : 2 * B, :])
    ssd.close()


def test_a_stateful_ssd_run_is_judged_and_charged_with_one_state(tmp_path: Path, monkeypatch) -> None:
    from mlx_lm.models.cache import ArraysCache

    from omlx.cache.block.kinds import cache_kinds

    kinds, _ = cache_kinds([KVCache(), ArraysCache(size=1)])
    fp = "e" * 64

    def open_stateful() -> PrefixCache:
        return PrefixCache(make_tiers(B, 1 << 30, ssd=tmp_path), fp, 2, "m", kinds=kinds)

    tokens = list(range(10, 10 + 8 * B))
    cache = open_stateful()
    arrays = ArraysCache(size=1)
    arrays.cache = [mx.ones((1, 64, 64))]  # 16 kB of state in every block, against 2 kB of KV
    layers = [kv(8 * B)[0], arrays]
    snap = cache.blocks.snapshot(layers)
    cache.store(tokens, layers, final=True, boundary_states={(i + 1) * B: snap for i in range(8)})
    while cache.write_back.step(idle=True):
        pass
    cache.tiers.ssd.close()
    kv_bytes, state_bytes = 8 * 2 * (2 * B * 8 * 4), 64 * 64 * 4
    cache = open_stateful()
    cache.costs.learn_size(kv_bytes // 8 + state_bytes, B, state_bytes)
    assert cache.costs.restore_bytes(8 * B) == kv_bytes + state_bytes
    cache.costs.prefill.observe(8 * B, 0, 1.0)  # recomputing the run: 1 s
    cache.costs.ssd_rate.observe(65536, 1.0)  # 64 kB/s: KV and one state in 0.5 s; a state per block would take 2.25 s
    observed: list[float] = []
    real = cache.costs.ssd_rate.observe
    monkeypatch.setattr(cache.costs.ssd_rate, "observe", lambda amount, seconds: observed.append(amount) or real(amount, seconds))
    caches, n = restore(cache, tokens + [1])
    assert n == 8 * B and cache.tiers.counters.skipped_restores == 0
    assert sum(observed) == kv_bytes + state_bytes  # the rate learns what was read: the KV and one state
    assert mx.array_equal(caches[1].cache[0], snap["1.arrays.0"]).item()
    observed.clear()
    keys = block_keys(fp, tokens, B)
    caches, n = restore(cache, tokens[: 5 * B] + [1])  # its KV hot (KV-only copies): block 5's state alone is read
    assert n == 5 * B and observed == [state_bytes] and not cache.tiers.device.peek(keys[4]).partial
    observed.clear()
    _, n = restore(cache, tokens[: 5 * B] + [1])  # and then nothing
    assert n == 5 * B and observed == []
    cache.tiers.ssd.close()


def test_a_tail_search_asks_the_tiers_only_of_keys_they_hold(tmp_path: Path, monkeypatch) -> None:
    # a stateful model's block is a prefill chunk (2,048 tokens on a GPU): asking every tier of each
    # of the 2,047 tail lengths took 15 ms of a cold prompt's admission
    cache = open_cache(tmp_path)
    tokens = list(range(10, 10 + 3 * B + 5))
    cache.store(tokens, kv(len(tokens)), final=True)
    asked: list[str] = []
    real = Tiers.tier_of
    monkeypatch.setattr(Tiers, "tier_of", lambda self, key, *a, **k: asked.append(key) or real(self, key, *a, **k))
    assert restore(cache, list(range(500, 500 + 3 * B)))[1] == 0 and asked == []  # a miss asks nothing
    _, n = restore(cache, tokens[: 3 * B + 3])  # three blocks and the stored tail's first two tokens
    assert n == 3 * B + 2 and len(asked) == 1
    cache.tiers.ssd.close()
