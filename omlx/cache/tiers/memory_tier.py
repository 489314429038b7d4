"""The in-memory tiers: an LRU of blocks under one byte budget shared by all loaded models (keys
include the fingerprint): device memory's of `CacheBlock`s and, on a discrete GPU, RAM's of
`HostBlock`s; each records its state in the tiers' directory under the lock it is given."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from omlx.cache.block.block import CacheBlock
from omlx.cache.tiers.residency import BlockDirectory, Residency

__all__ = ["MemoryTier"]


class MemoryTier:
    """LRU of blocks by key under `lock` (its own if not given); with a `directory` it records `state`
    (HOT or RAM) there for each key it holds; ``max_bytes == 0`` disables the tier."""

    def __init__(
        self,
        max_bytes: int,
        *,
        lock: threading.RLock | None = None,
        directory: BlockDirectory | None = None,
        state: Residency = Residency.NONE,
        on_evict: Callable[[Any], None] | None = None,
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self._max_bytes = int(max_bytes)
        self.on_evict = on_evict  # called with each block pushed out by the budget, outside the lock
        self._blocks: OrderedDict[str, Any] = OrderedDict()  # oldest first
        self._sizes: dict[str, int] = {}
        self._bytes = 0
        self.lock = lock if lock is not None else threading.RLock()  # every method takes it
        self._directory = directory  # where its keys' state is recorded
        self._state = state
        self._hits = 0
        self._misses = 0
        self._evictions = 0

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def enabled(self) -> bool:
        return self._max_bytes > 0

    def get(self, key: str) -> Any | None:
        """The block for ``key`` (now most recently used) or ``None``."""
        with self.lock:
            block = self._blocks.get(key)
            if block is None:
                self._misses += 1
                return None
            self._blocks.move_to_end(key)
            self._hits += 1
            return block

    def take(self, key: str) -> Any | None:
        """Remove and return the block for ``key`` (a hit: it moves to another tier) or ``None``."""
        with self.lock:
            block = self._pop(key)
            if block is None:
                self._misses += 1
            else:
                self._hits += 1
            return block

    def peek(self, key: str) -> Any | None:
        """The block for ``key`` or ``None``, leaving LRU order and counters alone."""
        with self.lock:
            return self._blocks.get(key)

    def touch(self, key: str) -> bool:
        """Mark ``key`` most recently used if present (no hit counted); whether it was."""
        with self.lock:
            if key not in self._blocks:
                return False
            self._blocks.move_to_end(key)
            return True

    def touch_many(self, keys: list[str]) -> None:
        """`touch` each of `keys` present, in this order (the last ends most recently used)."""
        with self.lock:
            for key in keys:
                if key in self._blocks:
                    self._blocks.move_to_end(key)

    def contains(self, key: str) -> bool:
        """Presence check that does not touch LRU order or hit counters."""
        with self.lock:
            return key in self._blocks

    def can_hold(self, nbytes: int) -> bool:
        """Whether a block of `nbytes` could be kept here at all (enabled, and within budget)."""
        return 0 < self._max_bytes and nbytes <= self._max_bytes

    def put(self, block: CacheBlock, keep: frozenset[str] | set[str] = frozenset()) -> bool:
        """Keep `block` as the most recently used, evicting the least recently used outside `keep` to fit
        (to `on_evict`); False (`block` to `on_evict`) when the tier is off, it exceeds the budget or only
        `keep` is left. A key present is refreshed; a whole block replaces a KV-only (`partial`) one."""
        partial = getattr(block, "partial", False)
        if partial and self._state == Residency.RAM:  # RAM keeps whole blocks only
            raise ValueError(f"block {block.key[:12]} holds only part of its tensors")
        size = block.nbytes
        evicted = []
        with self.lock:
            held = self._blocks.get(block.key)
            if held is not None and (partial or not getattr(held, "partial", False)):
                self._blocks.move_to_end(block.key)
                return True
            if not self.can_hold(size):
                stored = False
                evicted.append(block)
            else:
                old = self._pop(block.key) if held is not None else None  # a KV-only copy, upgraded: dropped
                victims = self._victims(size, keep)
                stored = victims is not None
                if victims is None:
                    evicted.append(block)
                    if old is not None:  # the whole block does not fit: the KV-only copy stays
                        self._insert(old)
                else:
                    for old_key in victims:
                        self._evictions += 1
                        evicted.append(self._pop(old_key))
                    self._insert(block)
        self._hand_over(evicted)
        return stored

    def _insert(self, block: CacheBlock) -> None:
        """Hold `block` (absent) as the most recently used, its state recorded (caller holds the lock);
        a `partial` (KV-only) block is marked KV_ONLY beside HOT: docs/design/cache-kinds.md."""
        size = block.nbytes
        self._blocks[block.key] = block
        self._sizes[block.key] = size
        self._bytes += size
        if self._directory is not None:
            self._directory.mark(block.key, self._flags(block))

    def _victims(self, size: int, keep: frozenset[str] | set[str]) -> list[str] | None:
        """Least recently used keys outside ``keep`` whose eviction makes room for ``size``
        bytes, or None when that is not possible (caller holds the lock)."""
        need = self._bytes + size - self._max_bytes
        victims: list[str] = []
        for key in self._blocks:
            if need <= 0:
                break
            if key not in keep:
                victims.append(key)
                need -= self._sizes[key]
        return victims if need <= 0 else None

    def _hand_over(self, evicted: list[Any]) -> None:
        if self.on_evict is not None:
            for old in evicted:
                self.on_evict(old)

    def discard(self, key: str) -> bool:
        """Drop one block (e.g. found inconsistent by the caller)."""
        with self.lock:
            return self._pop(key) is not None

    def _flags(self, block: Any) -> Residency:
        """The directory state of this tier holding `block`: KV_ONLY beside it for a `partial` one."""
        return self._state | Residency.KV_ONLY if getattr(block, "partial", False) else self._state

    def _pop(self, key: str) -> Any | None:
        """Remove `key`'s block, its bytes and its state (caller holds the lock)."""
        block = self._blocks.pop(key, None)
        if block is not None:
            self._bytes -= self._sizes.pop(key)
            if self._directory is not None:
                self._directory.unmark(key, self._flags(block))
        return block

    def discard_fingerprint(self, fingerprint: str) -> int:
        """Drop every block of one model; returns how many were dropped."""
        with self.lock:
            doomed = [k for k, b in self._blocks.items() if b.fingerprint == fingerprint]
            for k in doomed:
                self._pop(k)
            return len(doomed)

    def clear(self) -> None:
        with self.lock:
            for key in list(self._blocks):
                self._pop(key)

    def set_max_bytes(self, max_bytes: int) -> None:
        """Change the budget at run time (e.g. under memory pressure), evicting to fit."""
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        evicted = []
        with self.lock:
            self._max_bytes = int(max_bytes)
            while self._blocks and self._bytes > self._max_bytes:
                self._evictions += 1
                evicted.append(self._pop(next(iter(self._blocks))))
        self._hand_over(evicted)

    def shed(self, nbytes: int) -> int:
        """Evict least recently used blocks (to `on_evict`) until `nbytes` are freed or none
        is left; the bytes freed."""
        evicted, freed = [], 0
        with self.lock:
            while self._blocks and freed < nbytes:
                old_key = next(iter(self._blocks))
                freed += self._sizes[old_key]
                self._evictions += 1
                evicted.append(self._pop(old_key))
        self._hand_over(evicted)
        return freed

    @property
    def held_bytes(self) -> int:
        return self._bytes

    def stats(self) -> dict[str, int]:
        with self.lock:
            return {
                "blocks": len(self._blocks),
                "bytes": self._bytes,
                "max_bytes": self._max_bytes,
                "hits": self._hits,
                "misses": self._misses,
                "evictions": self._evictions,
            }
