"""The tiers every loaded model shares (keys include the model fingerprint): device memory, RAM on a
discrete GPU and the SSD, each block's residency in one directory, and the one lock they all take,
created here. Which thread calls what: docs/design/cache-threads.md."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omlx.cache.block.block import CacheBlock, HostBlock
from omlx.cache.plan.fingerprints import FingerprintBook
from omlx.cache.plan.restore_plan import Tier
from omlx.cache.tiers.counters import CacheCounters, CopyCounts
from omlx.cache.tiers.demotion import Demotion
from omlx.cache.tiers.memory_tier import MemoryTier
from omlx.cache.tiers.residency import ON_DEVICE, SSD_STATES, BlockDirectory, Residency
from omlx.cache.tiers.ssd.tier import SSDTier

# what a model's cache does with each of its blocks device memory let go (its RAM copy, if any)
Follower = Callable[[CacheBlock, HostBlock | None], None]


class Tiers:
    """Device memory (`device`, the hot tier), RAM (`ram`, None when off) and the SSD (`ssd`, None when off)
    under one lock (`lock`) and one residency `directory`; blocks device memory lets go go to RAM
    (`demotion`) and then to their model's follower (its write-back)."""

    def __init__(
        self,
        block_size: int,
        device_bytes: int,
        *,
        ram_bytes: int = 0,
        ssd_folder: Path | None = None,
        ssd_bytes: int = 0,
        demote_bound: int = 0,
        ssd_read_workers: int = 4,
        ssd_write_queue: int = 256,
    ) -> None:
        self.block_size = block_size
        self.lock = threading.RLock()  # every block's state, the LRUs, the SSD index and the waits below
        self.directory = BlockDirectory(self.lock)
        self.device = MemoryTier(device_bytes, lock=self.lock, directory=self.directory, state=Residency.HOT, on_evict=self._left_device)
        self.ram = MemoryTier(ram_bytes, lock=self.lock, directory=self.directory, state=Residency.RAM) if ram_bytes > 0 else None
        self.ssd: SSDTier | None = None
        if ssd_folder is not None and ssd_bytes > 0:
            self.ssd = SSDTier(
                ssd_folder, ssd_bytes, directory=self.directory, read_workers=ssd_read_workers, write_queue_max=ssd_write_queue
            )  # fmt: skip
        self.counters = CacheCounters()
        # each model's builds, beside the SSD's blocks where there is one (a miss's reason: cache-explain.md)
        self.fingerprints = FingerprintBook(self.ssd.folder / "fingerprints.json" if self.ssd is not None else None)
        self.copies = CopyCounts()
        self.demotion = Demotion(self.lock, self.directory, self.device, self.ram, self.copies, demote_bound) if self.ram else None
        self._followers: dict[str, Follower] = {}  # fingerprint -> its model's write-back (engine of that model)

    @property
    def demote_bound(self) -> int:
        """Bytes let go that may wait in device memory for their own engine's copy to RAM (0: none wait)."""
        return self.demotion.bound if self.demotion is not None else 0

    # ----- what a model's cache registers ------------------------------------------------
    def follow(self, fingerprint: str, on_evicted: Follower) -> None:
        """Call `on_evicted(block, host_copy)` for each block of that model device memory lets go."""
        with self.lock:
            self._followers[fingerprint] = on_evicted

    def unfollow(self, fingerprint: str, on_evicted: Follower) -> None:
        with self.lock:
            if self._followers.get(fingerprint) == on_evicted:  # a reloaded model's may have replaced it
                del self._followers[fingerprint]

    def _follower(self, fingerprint: str) -> Follower | None:
        with self.lock:
            return self._followers.get(fingerprint)

    def _left_device(self, block: CacheBlock) -> None:
        """Device memory let `block` go (the thread that put into it, outside the lock): a KV-only copy is
        dropped; else to RAM (at once or waiting for its engine), then to its model's follower."""
        if block.partial:  # no tier keeps or writes a block without its state
            return
        host = None
        if self.demotion is not None:
            waits, host = self.demotion.left_device(block)
            if waits:
                return
        follower = self._follower(block.fingerprint)
        if follower is not None:
            follower(block, host)

    # ----- demotion, driven by each model's engine ---------------------------------------
    def moved_in(self, nbytes: int) -> None:
        """A restore or store is about to put `nbytes` into device memory (`Demotion.moved_in`)."""
        if self.demotion is not None:
            self.demotion.moved_in(nbytes)

    def reclaim(self, key: str) -> CacheBlock | None:
        """A block waiting for its copy to RAM, taken back (it is wanted again: no copy)."""
        return self.directory.reclaim(key)[0]

    def demote(self, fingerprint: str, limit: int, due: bool) -> tuple[bool, int]:
        """That model's engine thread: `Demotion.demote`, each copy then handed to the model's follower."""
        if self.demotion is None:
            return False, 0

        def copied(block: CacheBlock, host: HostBlock) -> None:
            follower = self._follower(fingerprint)
            if follower is not None:
                follower(block, host)

        return self.demotion.demote(fingerprint, limit, due, copied)

    def own(self, fingerprint: str) -> None:
        """That model's engine copies its let-go blocks to RAM (`demote`)."""
        if self.demote_bound:
            self.demotion.own(fingerprint)  # type: ignore[union-attr]

    def disown(self, fingerprint: str) -> None:
        """At an engine's close: when it was the model's last, what waits is copied to RAM now (its
        engine's thread) and later evictions are copied at once."""
        if self.demote_bound and self.demotion.disown(fingerprint):  # type: ignore[union-attr]
            self.demote(fingerprint, limit=1 << 62, due=True)

    # ----- residency ---------------------------------------------------------------------
    def residency(self, key: str, fingerprint: str | None = None) -> Residency:
        """Where the block `key` is now, under the lock; the SSD tier's states (WRITING, SSD:
        `fingerprint`'s file) only given `fingerprint`."""
        with self.lock:
            state = self.directory.state(key)
            if fingerprint is None or self.ssd is None:
                return state & ~SSD_STATES
            indexed = self.ssd.indexed(key, fingerprint)
            if not indexed:
                state &= ~Residency.SSD
        if indexed is None and self.ssd.contains(key, fingerprint):  # index not built: the files tell
            state |= Residency.SSD
        return state

    def held(self, keys: list[str]) -> set[str] | None:
        """Those of `keys` some tier may hold; None while the SSD's index is not built (only its files tell)."""
        if self.ssd is not None and not self.ssd.wait_ready(0):
            return None
        return self.directory.held(keys)

    def on_device(self, key: str, whole: bool = False) -> bool:
        """Held in device memory: by the hot tier (with `whole`, not as a KV-only copy), or let go and waiting there."""
        state = self.directory.state(key)
        if whole and state & Residency.KV_ONLY:
            state &= ~Residency.HOT
        return bool(state & ON_DEVICE)

    def ram_bytes(self, key: str) -> int:
        """Bytes of `key`'s RAM copy (0: none)."""
        held = self.ram.peek(key) if self.ram is not None else None
        return held.nbytes if held is not None else 0

    def on_ssd(self, key: str, fingerprint: str) -> bool:
        return self.ssd is not None and self.ssd.contains(key, fingerprint)

    def device_can_hold(self, nbytes: int) -> bool:
        return self.device.can_hold(nbytes)

    def device_bytes(self) -> int:
        return self.device.max_bytes

    def has_ram(self) -> bool:
        return self.ram is not None

    def has_ssd(self) -> bool:
        return self.ssd is not None

    def tier_of(self, key: str, fingerprint: str, device_only: bool = False) -> Tier | None:
        """The fastest tier holding `key` whole (with `device_only`, device memory alone), or None."""
        if self.on_device(key, whole=True):
            return Tier.DEVICE
        if device_only:
            return None
        if self.ram_bytes(key):
            return Tier.RAM
        return Tier.SSD if self.on_ssd(key, fingerprint) else None

    def evicted(self, key: str) -> bool:
        """Whether `key` was held and every tier has let it go since (`BlockDirectory.evicted`)."""
        return self.directory.evicted(key)

    def touch_chain(self, keys: list[str]) -> None:
        """Mark one chain's blocks (root first) used in every tier holding them, deepest first, so its root
        ends the most recently used and eviction takes chains from their ends (a chain without its root
        serves no lookup); the lower tiers too, so a prefix served from memory is not what the SSD drops."""
        order = keys[::-1]
        for tier in (self.device, self.ram, self.ssd):
            if tier is not None:
                tier.touch_many(order)

    # ----- the server's side ---------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters per tier (any thread)."""
        return {
            "block_size": self.block_size,
            **self.counters.snapshot(),
            "unwritten_blocks": self.directory.unwritten_count(),  # stored, not yet handed to the SSD writer
            "demoting_bytes": self.directory.demoting_bytes,  # let go, waiting in device memory for the RAM copy
            "device_to_host": self.copies.snapshot(),
            "hot": self.device.stats(),
            "warm": self.ram.stats() if self.ram else {"enabled": False},
            "ssd": self.ssd.stats() if self.ssd else {"enabled": False},
        }

    def clear(self) -> None:
        """Drop every block of every tier and every wait (any thread); stores begun before add nothing."""
        self.directory.clear()
        if self.demotion is not None:
            self.demotion.forget_moved_in()
        self.device.clear()
        if self.ram:
            self.ram.clear()
        if self.ssd:
            self.ssd.clear()
        self.directory.forget_gone()

    def close(self) -> None:
        """At the server's end: the SSD writer finishes its queue."""
        if self.ssd:
            self.ssd.close()
