"""Write-back: stored blocks wait in device memory and are handed to the SSD writer later,
a bounded piece per engine loop, so no step waits for a whole prompt's device -> host copy.
Mixed into `PrefixCache`. Why and the figures: docs/design/write-back.md."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from omlx.cache.block import CacheBlock, HostBlock
from omlx.cache.residency import ON_DEVICE, Residency

log = logging.getLogger("omlx.cache")

# Blocks the hot tier let go that may wait in device memory for their copy to RAM on a CUDA
# GPU (`CacheStore.demote_bound`, at least this much); at most WRITE_BACK_CHUNK bytes per
# engine loop, so a step, or a request arriving at an idle engine, waits for at most that much
# copying, or one block where a block is larger (docs/design/write-back.md).
DEMOTE_BOUND_GPU = 1 << 30
WRITE_BACK_CHUNK = 16 << 20
# While requests run on a CUDA GPU, the engine thread's device -> host copies (RAM copies of
# blocks let go, hand-offs to the SSD writer) take at most this share of its time: each one
# holds up every stream (docs/design/write-back.md, "Copies while requests run").
BUSY_COPY_SHARE = 0.1
BUSY_COPY_BURST_S = 0.02  # the most time saved up for them: about one 8B block's copy


class CopyPacer:
    """Time a busy engine may spend on copies: each call of `ready` earns `share` of the
    time since the last one (up to `burst`), each copy spends its seconds (`spend`)."""

    def __init__(
        self, share: float = BUSY_COPY_SHARE, burst: float = BUSY_COPY_BURST_S, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.share, self.burst, self.clock = share, burst, clock
        self.balance = 0.0
        self._last: float | None = None

    def ready(self) -> bool:
        now = self.clock()
        if self._last is not None:
            self.balance = min(self.burst, self.balance + self.share * (now - self._last))
        self._last = now
        return self.balance >= 0

    def spend(self, seconds: float) -> None:
        self.balance -= seconds

    def rest(self) -> None:
        """Idle: what is copied now is not paced, and the idle time earns nothing."""
        self._last = None


class WriteBack:
    """`write_back` of `PrefixCache`: its stored blocks wait in the store's directory
    (`Residency.UNWRITTEN`) until they are handed to the SSD writer."""

    def _in_device_memory(self, key: str, whole: bool = False) -> bool:
        """Held in the hot tier (with `whole`, not as a KV-only copy), or let go by it but still
        waiting for the SSD or for RAM."""
        state = self.tiers.residency(key)
        if whole and state & Residency.KV_ONLY:
            state &= ~Residency.HOT
        return bool(state & ON_DEVICE)

    def _on_device(self, key: str) -> CacheBlock | None:
        """A block the hot tier let go that device memory still holds: one waiting for the SSD
        writer, or for its copy to RAM (taken back: no copy is needed now), or both."""
        directory = self.tiers.directory
        with directory.lock:
            leaving = self.tiers.reclaim(key)
            block = directory.unwritten_block(key)
        return block if block is not None else leaving

    def hold_writes(self, on: bool) -> None:
        if self.tiers.ssd is not None:
            self.tiers.ssd.hold_writes(self, on)

    def write_back(self, idle: bool) -> bool:
        """Copy this model's let-go blocks to RAM (`CacheStore.demote`), then hand stored blocks to the
        SSD writer, up to `WRITE_BACK_CHUNK` bytes; True when some moved and more wait. Busy, only
        blocks the hot tier let go move, within `CopyPacer`'s share (docs/design/write-back.md)."""
        if idle:
            self.pacer.rest()
            return self._write_back(idle)
        if not self.pacer.ready():
            return False
        tic = self.pacer.clock()
        try:
            return self._write_back(idle)
        finally:
            self.pacer.spend(self.pacer.clock() - tic)

    def _write_back(self, idle: bool) -> bool:
        more = self.tiers.demote_bound > 0 and self.tiers.demote(self.fp, WRITE_BACK_CHUNK, due=idle)
        ssd, directory = self.tiers.ssd, self.tiers.directory
        if ssd is None or not directory.unwritten(self.fp):  # the common case, after every engine step
            return more
        handed = 0
        while True:
            with directory.lock:
                block, evicted = directory.next_unwritten(self.fp)
                if block is None:
                    break
                if handed and handed + block.nbytes > WRITE_BACK_CHUNK:
                    break
                due = idle or evicted
                if not due or not ssd.has_room():
                    break
                directory.take_unwritten(block)
            handed += block.nbytes
            self._hand_to_ssd(self._host_copy(block))  # else copied to host memory here
        return more or (handed > 0 and directory.unwritten(self.fp) > 0)

    def _host_copy(self, block: CacheBlock) -> CacheBlock | HostBlock:
        """The RAM tier's copy of `block` if it has one (no second device -> host copy); made
        now for one that waits for it (`CacheStore.demote`), so that one copy serves both."""
        warm = self.tiers.warm
        if warm is None:
            return block
        if self.tiers.reclaim(block.key) is not None:
            return self.tiers.to_ram(block)
        held = warm.peek(block.key)
        return held if held is not None else block

    def _left_device(self, block: CacheBlock, host: HostBlock | None) -> None:
        """The hot tier let `block` go (any engine thread): if it waits for the SSD it goes to the
        writer now, as `host` (its RAM copy) where there is one; without one, another model's thread
        leaves it to this engine's next `write_back`, as does a writer without room."""
        directory = self.tiers.directory
        with directory.lock:
            if directory.unwritten_block(block.key) is None:
                return
            if (host is None and threading.get_ident() != self._owner) or not self.tiers.ssd.has_room():
                directory.mark_evicted(block.key)  # handed over first by this engine's next `write_back`
                return
            directory.take_unwritten(block)
        self._hand_to_ssd(host if host is not None else block)

    def _await_write_back(self, blocks: list[CacheBlock], generation: int) -> None:
        """Just stored `blocks` wait for `write_back`, root first (the writer's order), unless
        the store was cleared since `generation` (what was stored before a clear is not written)."""
        directory = self.tiers.directory
        with directory.lock:
            if generation != self.tiers.generation:
                return
            for block in blocks:
                directory.await_write(block)

    def _hand_to_ssd(self, block: CacheBlock | HostBlock) -> None:
        tic = time.perf_counter()
        try:
            self.tiers.ssd.put(block)
            if isinstance(block, CacheBlock):  # the writer's host view of it was made here
                self.tiers.copies.add("handed", block.nbytes, tic)
        except (RuntimeError, ValueError, OSError):  # that block is not written; caching is an optimisation
            log.exception("handing block %s to the SSD writer failed", block.key)

    @property
    def _unwritten_bytes(self) -> int:
        """Bytes of this model's blocks waiting for the SSD writer."""
        return self.tiers.directory.unwritten_bytes(self.fp)
