"""The cache tiers every loaded model shares, the directory of blocks between them, the
process-wide counters, and the hand-off of a block leaving device memory: to RAM, copied on
its own engine's thread, then to its model's `PrefixCache` (docs/design/ram-moves.md)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omlx.cache.block import CacheBlock, HostBlock
from omlx.cache.hot_tier import HotTier
from omlx.cache.residency import SSD_STATES, BlockDirectory, Residency
from omlx.cache.ssd_tier import SSDTier


@dataclass
class CacheCounters:
    """Process-wide request-level counters (the tiers count their own blocks)."""

    requests: int = 0
    hits: int = 0
    misses: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    skipped_restores: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "requests": self.requests,
                "hits": self.hits,
                "misses": self.misses,
                "prompt_tokens": self.prompt_tokens,
                "hit_tokens": self.hit_tokens,
                "hit_rate": (self.hit_tokens / self.prompt_tokens) if self.prompt_tokens else 0.0,
                "skipped_restores": self.skipped_restores,
            }


class CopyCounts:
    """Device -> host copies of blocks made on engine threads, by why: `evicted` (let go past what
    may wait, copied at once), `demoted` (waited, copied later) and `handed` (to the SSD writer
    from device memory); bytes and seconds of each, for `stats`."""

    KINDS = ("evicted", "demoted", "handed")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {kind: [0, 0.0] for kind in self.KINDS}

    def add(self, kind: str, nbytes: int, since: float) -> None:
        """One copy of `nbytes` that began at `since` (`time.perf_counter`)."""
        seconds = time.perf_counter() - since
        with self._lock:
            entry = self._counts[kind]
            entry[0] += nbytes
            entry[1] += seconds

    def snapshot(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {kind: {"bytes": n, "seconds": round(s, 4)} for kind, (n, s) in self._counts.items()}


class CacheStore:
    """The tiers every loaded model shares (keys include the model fingerprint), the directory
    of blocks between them, and the hand-off of blocks the hot tier lets go: to RAM as host
    bytes, then to their model's `PrefixCache` (`follow`), which hands them to the SSD writer."""

    def __init__(
        self, hot: HotTier, ssd: SSDTier | None, block_size: int, warm: HotTier | None = None, demote_bound: int = 0
    ):
        self.hot = hot
        self.warm = warm if warm is not None and warm.enabled else None
        self.ssd = ssd if ssd is not None and ssd.enabled else None
        self.block_size = block_size
        self.counters = CacheCounters()
        self.copies = CopyCounts()
        self.generation = 0  # bumped by clear(): blocks stored before it are not written back
        # model fingerprint -> what its PrefixCache does with a block the hot tier let go
        self._followers: dict[str, Callable[[CacheBlock, HostBlock | None], None]] = {}
        # Blocks the hot tier let go wait in device memory (up to `demote_bound` bytes) for their
        # own engine to copy them to RAM (`demote`), between steps or when idle: copied at
        # eviction, the copy would hold up the engine that stored, and every request behind it.
        self.demote_bound = demote_bound if self.warm is not None and hot.enabled else 0
        # one directory (the SSD tier's, where it records WRITING and SSD; the hot and RAM tiers
        # record HOT and RAM) and one lock for it, the tiers and the bookkeeping below
        self.directory = self.ssd.block_directory if self.ssd is not None else BlockDirectory()
        hot.join(self.directory, Residency.HOT)
        if self.warm is not None:
            self.warm.join(self.directory, Residency.RAM)
        self._leaving_lock = self.directory.lock
        self._restored = 0  # bytes restores moved into the hot tier since nothing waited (`moved_in`)
        # fingerprint -> engines (a reload may overlap the old engine's close) that demote its blocks
        self._owners: dict[str, int] = {}
        self.hot.on_evict = self._left_device

    def follow(self, fingerprint: str, on_evicted: Callable[[CacheBlock, HostBlock | None], None]) -> None:
        """Call `on_evicted(block, host_copy)` for each block of that model the hot tier lets go."""
        self._followers[fingerprint] = on_evicted

    def unfollow(self, fingerprint: str, on_evicted: Callable[[CacheBlock, HostBlock | None], None]) -> None:
        if self._followers.get(fingerprint) == on_evicted:  # a reloaded model's may have replaced it
            del self._followers[fingerprint]

    def own(self, fingerprint: str) -> None:
        """That model's engine will demote its blocks the hot tier lets go (`demote`)."""
        with self._leaving_lock:
            self._owners[fingerprint] = self._owners.get(fingerprint, 0) + 1

    def _left_device(self, block: CacheBlock) -> None:
        """A block leaving device memory goes to RAM, copied out, unless RAM holds it already; the
        copy waits for its own engine while `demote_bound` allows, past it is made now (the SSD's
        smaller budget may evict its file: docs/design/long-context.md)."""
        if block.partial:  # a KV-only copy is dropped: no tier keeps or writes a block without its state
            return
        host = None
        if self.warm is not None:
            if self.warm.touch(block.key):
                host = self.warm.peek(block.key)
            elif self._defer(block):
                return
            else:
                tic = time.perf_counter()
                host = HostBlock.of(block, copy=True)
                self.copies.add("evicted", block.nbytes, tic)
                self.warm.put(host)
        follower = self._followers.get(block.fingerprint)
        if follower is not None:
            follower(block, host)

    def _defer(self, block: CacheBlock) -> bool:
        if not self.hot.can_hold(block.nbytes):  # never held by the hot tier: no device memory to spare
            return False
        with self._leaving_lock:
            if self.directory.is_leaving(block.key):  # taken back for the SSD writer, and let go again
                self.directory.leave(block, self.generation)  # refreshed in the order
                return True
            if block.fingerprint not in self._owners or self.directory.leaving_bytes + block.nbytes > self._bound():
                return False
            self.directory.leave(block, self.generation)
        return True

    def moved_in(self, nbytes: int) -> None:
        """A restore or a store is about to put `nbytes` into the hot tier: the blocks it pushes out
        may wait that many bytes beyond `demote_bound` for their copy to RAM (up to the hot tier's
        size, until nothing waits: docs/design/ram-moves.md)."""
        if self.demote_bound:
            with self._leaving_lock:
                self._restored += nbytes

    def _bound(self) -> int:
        """Bytes that may wait for their copy to RAM now (caller holds `_leaving_lock`)."""
        return self.demote_bound + min(self._restored, self.hot.max_bytes)

    def residency(self, key: str, fingerprint: str | None = None) -> Residency:
        """Where the block `key` is now: its state in the directory, under one lock; the SSD tier's
        (WRITING, SSD: `fingerprint`'s file) only given `fingerprint`."""
        with self.directory.lock:
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
        """Those of `keys` some tier may hold (their directory states); None while the SSD's index is
        not built, when only its files can tell."""
        if self.ssd is not None and not self.ssd.wait_ready(0):
            return None
        return self.directory.held(keys)

    def leaving(self, key: str) -> bool:
        """Whether the block waits in device memory for its copy to RAM."""
        return self.directory.is_leaving(key)

    def reclaim(self, key: str) -> CacheBlock | None:
        """A block waiting for its copy to RAM, taken back (it is wanted again: no copy)."""
        return self.directory.reclaim(key)[0]

    def demote(self, fingerprint: str, limit: int, due: bool) -> bool:
        """On that model's engine thread: copy its blocks waiting to leave device memory to RAM,
        oldest first, up to `limit` bytes (one at least), when `due` or while they fill over half of
        what may wait; True when some still wait."""
        return self.demoted(fingerprint, limit, due)[0]

    def demoted(self, fingerprint: str, limit: int, due: bool) -> tuple[bool, int]:
        """`demote`, and the bytes it copied (or dropped) from device memory."""
        moved = 0
        while True:
            with self._leaving_lock:
                block = self.directory.oldest_leaving(fingerprint)
                if block is None:
                    if not self.directory.any_leaving():
                        self._restored = 0
                    return False, moved
                urgent = self.directory.leaving_bytes > self._bound() // 2
                if not (due or urgent) or (moved and moved + block.nbytes > limit):
                    return True, moved
                block, generation = self.directory.reclaim(block.key)
                assert block is not None
                self._restored = max(0, self._restored - block.nbytes)  # a busy engine may never empty it
            moved += block.nbytes
            if generation != self.generation:  # stored before a clear(): dropped
                continue
            host = self.to_ram(block)
            follower = self._followers.get(fingerprint)
            if follower is not None:
                follower(block, host)

    def to_ram(self, block: CacheBlock) -> HostBlock:
        """`block`'s RAM copy, made now (engine thread) if RAM has none."""
        held = self.warm.peek(block.key)
        if held is None:
            tic = time.perf_counter()
            held = HostBlock.of(block, copy=True)
            self.copies.add("demoted", block.nbytes, tic)
            self.warm.put(held)
        return held

    def disown(self, fingerprint: str) -> None:
        """At an engine's close: when it was the model's last, what waits is copied to RAM now
        (this is its engine's thread) and later evictions are copied at once."""
        with self._leaving_lock:
            left = self._owners.get(fingerprint, 0) - 1
            if left > 0:
                self._owners[fingerprint] = left
                return
            self._owners.pop(fingerprint, None)
        self.demote(fingerprint, limit=1 << 62, due=True)

    def stats(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size,
            **self.counters.snapshot(),
            "unwritten_blocks": self.directory.unwritten_count(),  # stored, not yet handed to the SSD writer
            "demoting_bytes": self.directory.leaving_bytes,  # evicted, waiting in device memory for the RAM copy
            "device_to_host": self.copies.snapshot(),
            "hot": self.hot.stats(),
            "warm": self.warm.stats() if self.warm else {"enabled": False},
            "ssd": self.ssd.stats() if self.ssd else {"enabled": False},
        }

    def clear(self) -> None:
        with self._leaving_lock:
            self.generation += 1
            self.directory.clear()
            self._restored = 0
        self.hot.clear()
        if self.warm:
            self.warm.clear()
        if self.ssd:
            self.ssd.clear()

    def close(self) -> None:
        if self.ssd:
            self.ssd.close()
