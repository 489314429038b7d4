"""Where each block is: one `Residency` per key (`Tiers.residency`) in one `BlockDirectory` under
the tiers' lock, the tiers recording theirs (device memory HOT and KV_ONLY, RAM RAM, the SSD tier
WRITING and SSD); callers deciding on several states hold `lock` (reentrant). docs/design/cache-threads.md."""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from omlx.cache.block.block import CacheBlock


class Residency(enum.Flag):
    """A block's state: one value per key, of flags that may combine (a hot block may be
    unwritten, a RAM block on the SSD too)."""

    NONE = 0
    HOT = enum.auto()  # in the hot tier (device memory, within its budget)
    KV_ONLY = enum.auto()  # with HOT: the hot copy lacks its state (a KV-only read: cache-kinds.md)
    RAM = enum.auto()  # in the RAM tier (host memory)
    WRITING = enum.auto()  # queued for the SSD writer or being written
    SSD = enum.auto()  # a file of the SSD tier
    UNWRITTEN = enum.auto()  # stored, waits in device memory to be handed to the SSD writer
    EVICTED = enum.auto()  # unwritten, let go by the hot tier before it could be handed over
    DEMOTING = enum.auto()  # let go by the hot tier, waits in device memory for its copy to RAM


# Keys let go by every tier that the directory remembers (oldest forgotten first), so a miss can say
# "evicted" rather than "never cached" (docs/design/cache-explain.md).
GONE_KEYS = 16_384

ON_DEVICE = Residency.HOT | Residency.UNWRITTEN | Residency.DEMOTING  # device memory holds it
SSD_STATES = Residency.WRITING | Residency.SSD  # the SSD tier's, recorded by it (`SSDTier`, `SSDIndex`)
HOT_STATES = Residency.HOT | Residency.KV_ONLY  # device memory's, recorded by its `MemoryTier`
TIER_STATES = HOT_STATES | Residency.RAM | SSD_STATES  # recorded by the tiers (`mark`), dropped by their `clear`


@dataclass(slots=True)
class _Entry:
    state: Residency
    block: CacheBlock | None = None  # the device copy (UNWRITTEN, DEMOTING)
    generation: int = 0  # of the directory when it began to wait for its copy to RAM (DEMOTING)


class BlockDirectory:
    """Each key's `Residency` and what it holds, with the orders the waits are served in (unwritten:
    per model, oldest stored first; demoting: oldest let go first), under `lock` (its own if not given)."""

    def __init__(self, lock: threading.RLock | None = None) -> None:
        self.lock = lock if lock is not None else threading.RLock()
        self._entries: dict[str, _Entry] = {}
        self._unwritten: dict[str, OrderedDict[str, None]] = {}  # fingerprint -> keys
        self._unwritten_bytes: dict[str, int] = {}
        self._evicted: dict[str, int] = {}  # fingerprint -> its unwritten blocks marked EVICTED
        self._demoting: OrderedDict[str, None] = OrderedDict()
        self.demoting_bytes = 0
        self.generation = 0  # bumped by `clear`: what was stored or let go before it is not written or copied
        self._gone: OrderedDict[str, None] = OrderedDict()  # keys no tier holds any more (`GONE_KEYS`)

    def state(self, key: str) -> Residency:
        with self.lock:
            entry = self._entries.get(key)
            return entry.state if entry is not None else Residency.NONE

    def held(self, keys: list[str]) -> set[str]:
        """Those of `keys` with any state here (one lock for all: a tail search asks of ~a block's worth)."""
        with self.lock:
            return {k for k in keys if k in self._entries}

    def on_device(self, key: str) -> bool:
        """Whether device memory holds the block outside the hot tier (unwritten or demoting)."""
        return bool(self.state(key) & (Residency.UNWRITTEN | Residency.DEMOTING))

    def _set(self, key: str, state: Residency, **fields: object) -> _Entry:
        """Add `state` to `key`'s (caller holds the lock)."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(Residency.NONE)
            self._gone.pop(key, None)
        entry.state |= state
        for name, value in fields.items():
            setattr(entry, name, value)
        return entry

    def _unset(self, key: str, state: Residency) -> _Entry | None:
        """Remove `state` from `key`'s; its entry, None when it had none of `state` (caller
        holds the lock)."""
        entry = self._entries.get(key)
        if entry is None or not entry.state & state:
            return None
        entry.state &= ~state
        if not entry.state:
            del self._entries[key]
            self._gone[key] = None
            if len(self._gone) > GONE_KEYS:
                self._gone.popitem(last=False)
        return entry

    def evicted(self, key: str) -> bool:
        """Whether `key` was held by some tier and let go since (remembered for the last `GONE_KEYS`)."""
        with self.lock:
            return key in self._gone and key not in self._entries

    def forget_gone(self) -> None:
        """After a clear: what it dropped was not let go for room."""
        with self.lock:
            self._gone.clear()

    # ----- waiting for the SSD writer (`write_back`) -----------------------------------
    def await_write(self, block: CacheBlock) -> None:
        """`block` was stored: it waits for the SSD writer (behind its model's others)."""
        with self.lock:
            if self.state(block.key) & Residency.UNWRITTEN:
                return
            self._set(block.key, Residency.UNWRITTEN, block=block)
            self._unwritten.setdefault(block.fingerprint, OrderedDict())[block.key] = None
            self._unwritten_bytes[block.fingerprint] = self._unwritten_bytes.get(block.fingerprint, 0) + block.nbytes

    def unwritten_block(self, key: str) -> CacheBlock | None:
        with self.lock:
            entry = self._entries.get(key)
            return entry.block if entry is not None and entry.state & Residency.UNWRITTEN else None

    def unwritten(self, fingerprint: str) -> int:
        """How many of that model's blocks wait for the SSD writer."""
        with self.lock:
            return len(self._unwritten.get(fingerprint, ()))

    def unwritten_bytes(self, fingerprint: str) -> int:
        with self.lock:
            return self._unwritten_bytes.get(fingerprint, 0)

    def unwritten_count(self) -> int:
        """Blocks of every model that wait for the SSD writer."""
        with self.lock:
            return sum(len(keys) for keys in self._unwritten.values())

    def next_unwritten(self, fingerprint: str) -> tuple[CacheBlock | None, bool]:
        """The block of that model to hand to the writer next: one the hot tier let go before
        it could be handed over first (then True), else the oldest stored; (None, False) when none."""
        with self.lock:
            keys = self._unwritten.get(fingerprint)
            if not keys:
                return None, False
            if not self._evicted.get(fingerprint):  # no scan: a busy engine asks after every step
                return self._entries[next(iter(keys))].block, False
            for key in keys:
                entry = self._entries[key]
                if entry.state & Residency.EVICTED:
                    return entry.block, True
            return self._entries[next(iter(keys))].block, False

    def mark_evicted(self, key: str) -> None:
        """An unwritten block the hot tier let go that could not be handed over then (on another
        model's thread, or with the writer full): its own engine hands it over first."""
        with self.lock:
            entry = self._entries.get(key)
            if entry is not None and entry.state & Residency.UNWRITTEN and not entry.state & Residency.EVICTED:
                self._set(key, Residency.EVICTED)
                assert entry.block is not None  # an unwritten entry holds its block
                fingerprint = entry.block.fingerprint
                self._evicted[fingerprint] = self._evicted.get(fingerprint, 0) + 1

    def take_unwritten(self, block: CacheBlock) -> bool:
        """`block` no longer waits for the writer (handed over); whether it did."""
        with self.lock:
            entry = self._entries.get(block.key)
            if entry is None or not entry.state & Residency.UNWRITTEN:
                return False
            if entry.state & Residency.EVICTED:
                self._evicted[block.fingerprint] -= 1
            self._unset(block.key, Residency.UNWRITTEN | Residency.EVICTED)
            if not entry.state & Residency.DEMOTING:
                entry.block = None
            keys = self._unwritten[block.fingerprint]
            del keys[block.key]
            self._unwritten_bytes[block.fingerprint] -= block.nbytes
            if not keys:
                del self._unwritten[block.fingerprint], self._unwritten_bytes[block.fingerprint]
                self._evicted.pop(block.fingerprint, None)
            return True

    def drop_unwritten(self, fingerprint: str) -> int:
        """None of that model's blocks waits for the writer any more; how many did."""
        with self.lock:
            keys = list(self._unwritten.get(fingerprint, ()))
            for key in keys:
                block = self._entries[key].block
                assert block is not None
                self.take_unwritten(block)
            return len(keys)

    # ----- waiting for the copy to RAM (`Demotion`) -------------------------------------
    def demote_later(self, block: CacheBlock) -> bool:
        """`block` waits in device memory for its copy to RAM; False (refreshed in the order)
        when it waited already."""
        with self.lock:
            if self.state(block.key) & Residency.DEMOTING:
                self._demoting.move_to_end(block.key)
                return False
            entry = self._set(block.key, Residency.DEMOTING, generation=self.generation)
            if entry.block is None:
                entry.block = block
            self._demoting[block.key] = None
            self.demoting_bytes += block.nbytes
            return True

    def is_demoting(self, key: str) -> bool:
        return bool(self.state(key) & Residency.DEMOTING)

    def reclaim(self, key: str) -> tuple[CacheBlock | None, int]:
        """A block waiting for its copy to RAM, taken back (no copy is needed now), with the
        directory's generation when it began to wait; (None, 0) when it did not wait."""
        with self.lock:
            entry = self._entries.get(key)
            if entry is None or not entry.state & Residency.DEMOTING:
                return None, 0
            block, generation = entry.block, entry.generation
            self._unset(key, Residency.DEMOTING)
            if not entry.state & Residency.UNWRITTEN:
                entry.block = None
            del self._demoting[key]
            assert block is not None
            self.demoting_bytes -= block.nbytes
            return block, generation

    def oldest_demoting(self, fingerprint: str) -> CacheBlock | None:
        """That model's block that began to wait for its copy to RAM first, or None."""
        with self.lock:
            for key in self._demoting:
                block = self._entries[key].block
                if block is not None and block.fingerprint == fingerprint:
                    return block
            return None

    def any_demoting(self) -> bool:
        with self.lock:
            return bool(self._demoting)

    def demoting_blocks(self) -> Iterator[CacheBlock]:
        """The blocks waiting for their copy to RAM (a snapshot)."""
        with self.lock:
            blocks = [self._entries[key].block for key in self._demoting]
        return iter([b for b in blocks if b is not None])

    # ----- the tiers' states (`MemoryTier`: HOT, KV_ONLY, RAM; `SSDTier`: WRITING; `SSDIndex`: SSD) -----
    def mark(self, key: str, state: Residency) -> None:
        """Add one of the tiers' states (`TIER_STATES`) to `key`'s."""
        assert not state & ~TIER_STATES, state
        with self.lock:
            self._set(key, state)

    def unmark(self, key: str, state: Residency) -> None:
        with self.lock:
            self._unset(key, state)

    def keys_with(self, state: Residency) -> set[str]:
        """The keys whose state has any of `state` (a snapshot)."""
        with self.lock:
            return {key for key, entry in self._entries.items() if entry.state & state}

    def clear(self) -> None:
        """Nothing waits any more (`Tiers.clear`), and the generation moves on; the tiers' states
        stay, for their own `clear` to drop (the SSD tier's with its files)."""
        with self.lock:
            self.generation += 1
            for key in list(self._entries):
                if not self._entries[key].state & TIER_STATES:
                    del self._entries[key]
                else:
                    self._entries[key] = _Entry(self._entries[key].state & TIER_STATES)
            self._unwritten.clear()
            self._unwritten_bytes.clear()
            self._evicted.clear()
            self._demoting.clear()
            self.demoting_bytes = 0
