"""Write-back: stored blocks wait in device memory and are handed to the SSD writer later,
a bounded piece per engine loop, so no step waits for a whole prompt's device -> host copy.
Mixed into `PrefixCache`. Why and the figures: docs/design/write-back.md."""

from __future__ import annotations

import logging
import threading

from omlx.cache.block import CacheBlock, HostBlock
from omlx.cache.residency import ON_DEVICE, Residency

log = logging.getLogger("omlx.cache")

# Blocks that may wait for the SSD in device memory while a CUDA engine is busy (beyond it,
# the oldest are handed over between steps); at most WRITE_BACK_CHUNK bytes per engine loop,
# so a step, or a request arriving at an idle engine, waits for at most that much copying, or
# one block where a block is larger (docs/design/write-back.md).
WRITE_BACK_BOUND_GPU = 1 << 30
WRITE_BACK_CHUNK = 16 << 20


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
        """Copy this model's let-go blocks to RAM (`CacheStore.demote`), then hand stored blocks to
        the SSD writer, oldest first, up to `WRITE_BACK_CHUNK` bytes (one at least) when `idle` or
        past their bound, while it has room; True when some moved and more wait."""
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
                due = idle or evicted or directory.unwritten_bytes(self.fp) > self.write_back_bound
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
            if host is None and threading.get_ident() != self._owner:
                directory.mark_evicted(block.key)  # for this engine's thread to copy out, next loop
                return
            if not self.tiers.ssd.has_room():
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
        try:
            self.tiers.ssd.put(block)
        except (RuntimeError, ValueError, OSError):  # that block is not written; caching is an optimisation
            log.exception("handing block %s to the SSD writer failed", block.key)

    @property
    def _unwritten_bytes(self) -> int:
        """Bytes of this model's blocks waiting for the SSD writer."""
        return self.tiers.directory.unwritten_bytes(self.fp)
