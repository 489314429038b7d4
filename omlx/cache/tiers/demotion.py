"""Demotion: blocks device memory lets go move to RAM as host copies. A copy waits for the block's
own engine (up to a bound, beyond what restores and stores just brought in), else it is made on the
thread that let the block go. Why: docs/design/ram-moves.md; threads: docs/design/cache-threads.md."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from omlx.cache.block.block import CacheBlock, HostBlock
from omlx.cache.tiers.counters import CopyCounts
from omlx.cache.tiers.memory_tier import MemoryTier
from omlx.cache.tiers.residency import BlockDirectory

# Blocks device memory let go may wait there this many bytes at least for their copy to RAM on a
# discrete GPU (the bound is the hot tier's size where larger: docs/design/ram-moves.md).
DEMOTE_BOUND_GPU = 1 << 30


class Demotion:
    """Device memory -> RAM for the blocks `device` lets go, under the tiers' `lock`; `bound`: bytes
    that may wait for their own engine's `demote` (0: copied at once)."""

    def __init__(
        self,
        lock: threading.RLock,
        directory: BlockDirectory,
        device: MemoryTier,
        ram: MemoryTier,
        copies: CopyCounts,
        bound: int,
    ) -> None:
        self.lock, self.directory, self.device, self.ram, self.copies = lock, directory, device, ram, copies
        self.bound = bound if device.enabled else 0
        self._moved_in = 0  # bytes restores and stores moved into device memory since nothing waited
        self._engines: dict[str, int] = {}  # fingerprint -> engines that demote its blocks (a reload may overlap)

    def left_device(self, block: CacheBlock) -> tuple[bool, HostBlock | None]:
        """(whether `block` now waits for its engine's `demote`, its RAM copy otherwise): RAM's own if it
        holds one, else made now on this thread (beyond the bound, or with no engine of its model)."""
        if self.ram.touch(block.key):
            return False, self.ram.peek(block.key)
        if self._wait(block):
            return True, None
        tic = time.perf_counter()
        host = HostBlock.of(block, copy=True)
        self.copies.add("evicted", block.nbytes, tic)
        self.ram.put(host)
        return False, host

    def _wait(self, block: CacheBlock) -> bool:
        if not self.device.can_hold(block.nbytes):  # never held by the hot tier: no device memory to spare
            return False
        with self.lock:
            if self.directory.is_demoting(block.key):  # taken back for the SSD writer, and let go again
                self.directory.demote_later(block)  # refreshed in the order
                return True
            if block.fingerprint not in self._engines or self.directory.demoting_bytes + block.nbytes > self._allowed():
                return False
            self.directory.demote_later(block)
        return True

    def moved_in(self, nbytes: int) -> None:
        """A restore or a store is about to put `nbytes` into device memory: the blocks it pushes out may wait
        that many bytes beyond the bound (up to the hot tier's size, until nothing waits)."""
        if self.bound:
            with self.lock:
                self._moved_in += nbytes

    def forget_moved_in(self) -> None:
        """Nothing waits any more (a clear)."""
        with self.lock:
            self._moved_in = 0

    def _allowed(self) -> int:
        """Bytes that may wait for their copy to RAM now (caller holds the lock)."""
        return self.bound + min(self._moved_in, self.device.max_bytes)

    def demote(
        self, fingerprint: str, limit: int, due: bool, on_copied: Callable[[CacheBlock, HostBlock], None]
    ) -> tuple[bool, int]:
        """On that model's engine thread: copy its waiting blocks to RAM, oldest first, up to `limit` bytes
        (one at least), when `due` or while they fill over half of what may wait; (whether some still
        wait, the bytes taken out of device memory). `on_copied(block, host)` follows each copy."""
        moved = 0
        while True:
            with self.lock:
                block = self.directory.oldest_demoting(fingerprint)
                if block is None:
                    if not self.directory.any_demoting():
                        self._moved_in = 0
                    return False, moved
                urgent = self.directory.demoting_bytes > self._allowed() // 2
                if not (due or urgent) or (moved and moved + block.nbytes > limit):
                    return True, moved
                block, generation = self.directory.reclaim(block.key)
                assert block is not None
                self._moved_in = max(0, self._moved_in - block.nbytes)  # a busy engine may never empty it
            moved += block.nbytes
            if generation != self.directory.generation:  # let go before a clear(): dropped
                continue
            on_copied(block, self.to_ram(block))

    def to_ram(self, block: CacheBlock) -> HostBlock:
        """`block`'s RAM copy, made now (its engine's thread) if RAM has none."""
        held = self.ram.peek(block.key)
        if held is None:
            tic = time.perf_counter()
            held = HostBlock.of(block, copy=True)
            self.copies.add("demoted", block.nbytes, tic)
            self.ram.put(held)
        return held

    def own(self, fingerprint: str) -> None:
        """That model's engine will `demote` its blocks device memory lets go."""
        with self.lock:
            self._engines[fingerprint] = self._engines.get(fingerprint, 0) + 1

    def disown(self, fingerprint: str) -> bool:
        """An engine of that model closes; True when it was the last (what waits must be copied now)."""
        with self.lock:
            left = self._engines.get(fingerprint, 0) - 1
            if left > 0:
                self._engines[fingerprint] = left
                return False
            self._engines.pop(fingerprint, None)
        return True
