"""The SSD tier's index: its block files by key, least recently used first, with their bytes;
each indexed key is `Residency.SSD` in the block directory. Not thread-safe on its own: the
directory's lock (the tier's) guards every call."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

from omlx.cache.tiers.residency import BlockDirectory, Residency


@dataclass
class Entry:
    size: int
    fingerprint: str


class SSDIndex:
    """Entries by key in LRU order (oldest first) and the bytes they add up to; `directory`
    has SSD in a key's state exactly while the key is indexed."""

    def __init__(self, directory: BlockDirectory) -> None:
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self.bytes = 0
        self._directory = directory

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[str]:
        """Keys, least recently used first."""
        return iter(self._entries)

    def get(self, key: str) -> Entry | None:
        return self._entries.get(key)

    def add(self, key: str, size: int, fingerprint: str) -> None:
        """Index a file (replacing what was indexed under `key`), as the most recently used."""
        self.pop(key)
        self._entries[key] = Entry(size, fingerprint)
        self.bytes += size
        self._directory.mark(key, Residency.SSD)

    def pop(self, key: str) -> Entry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.size
            self._directory.unmark(key, Residency.SSD)
        return entry

    def pop_oldest(self) -> tuple[str, Entry]:
        key, entry = self._entries.popitem(last=False)
        self.bytes -= entry.size
        self._directory.unmark(key, Residency.SSD)
        return key, entry

    def touch(self, key: str) -> None:
        """Mark `key` most recently used, if indexed."""
        if key in self._entries:
            self._entries.move_to_end(key)

    def recent(self, fingerprint: str, n: int) -> list[str]:
        """Up to `n` keys of `fingerprint`'s blocks, the most recently used first."""
        out: list[str] = []
        for key in reversed(self._entries):
            if self._entries[key].fingerprint == fingerprint:
                out.append(key)
                if len(out) == n:
                    break
        return out

    def rebuild(self, found: list[tuple[int, str, int, str]], removed: set[str]) -> None:
        """The index of a scan's `found` (oldest first) but `removed`; entries indexed during
        the scan (hits, writes) stay, as the newest."""
        rebuilt: OrderedDict[str, Entry] = OrderedDict()
        for _mtime, key, size, fingerprint in found:
            if key not in removed:
                rebuilt[key] = Entry(size, fingerprint)
                self._directory.mark(key, Residency.SSD)
        for key, entry in self._entries.items():
            rebuilt.pop(key, None)
            rebuilt[key] = entry
        self._entries = rebuilt
        self.bytes = sum(e.size for e in rebuilt.values())

    def clear(self) -> None:
        for key in self._entries:
            self._directory.unmark(key, Residency.SSD)
        self._entries.clear()
        self.bytes = 0
