"""SSD (cold) tier: one safetensors file per block (`ssd_format`), written in the background
by a daemon thread (temp file, fsync, rename), LRU-evicted under a byte budget; a bad file is
discarded and counted, never served. Why this shape: docs/design/write-back.md."""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from omlx.cache.block.block import CacheBlock, HostBlock, HostTensors
from omlx.cache.tiers.residency import BlockDirectory, Residency
from omlx.cache.tiers.ssd.files import (
    fsync_dir,
    looks_like_io_error,
    lower_thread_priority,
    scan_files,
    unlink,
)
from omlx.cache.tiers.ssd.format import (
    ALL,
    FORMAT_VERSION,
    SUFFIX,
    TMP_MARK,
    CorruptBlockFile,
    block_metadata,
    is_key,
    load_block,
    read_header,
    write_block,
)
from omlx.cache.tiers.ssd.index import SSDIndex
from omlx.cache.tiers.ssd.reads import ReadPools, TimedRead

__all__ = ["SSDTier", "TimedRead", "FORMAT_VERSION", "read_header", "CorruptBlockFile"]

log = logging.getLogger(__name__)

HOLD_MAX_S = 10.0  # the longest the writer waits for `hold_writes` holders before writing anyway
_COUNTERS = ("hits", "misses", "writes", "write_errors", "dropped_writes", "evictions", "discarded", "stale_tmp_removed")
_tmp_counter = itertools.count()  # process-wide, so two tiers never pick the same temp name


class SSDTier:
    """Persistent block store under `folder` with an LRU byte budget (0: off, nothing touched).
    The index is rebuilt from file headers on the writer thread; until then lookups ask the file
    system. One `SSDTier` per directory per process."""

    def __init__(
        self,
        folder: Path,
        max_bytes: int,
        *,
        write_queue_max: int = 256,
        read_workers: int = 4,
        directory: BlockDirectory | None = None,
    ) -> None:
        """`directory`: where each block's WRITING and SSD are kept, under its lock (the tiers', which
        also guards this tier's index and counters; never held across file I/O); its own if not given."""
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.folder = Path(folder)
        self._max_bytes = int(max_bytes)
        self._reads = ReadPools(read_workers)
        self.directory = directory if directory is not None else BlockDirectory()
        self._lock = self.directory.lock
        self._io_lock = threading.Lock()  # one writer of files at a time (writer vs clear)
        self._index = SSDIndex(self.directory)
        self._ready = threading.Event()
        self._scan_removed: set[str] = set()
        self._queue: queue.Queue[CacheBlock | None] = queue.Queue(maxsize=max(1, write_queue_max))
        self._inflight = 0
        self._idle = threading.Condition(self._lock)
        # engines prefilling a prompt alone (`hold_writes`): the writer waits between files
        self._holders: set[object] = set()
        self._unheld = threading.Condition(self._lock)
        self._closed = False
        self._writes_disabled = False
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._thread: threading.Thread | None = None
        if self._max_bytes > 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._run, name="omlx-ssd-writer", daemon=True)
            self._thread.start()
        else:
            self._ready.set()

    # ------------------------------------------------------------------ properties

    @property
    def enabled(self) -> bool:
        return self._max_bytes > 0

    @property
    def read_workers(self) -> int:
        """Reads that run at once on each of the reader pools."""
        return self._reads.workers

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def writes_disabled(self) -> bool:
        return self._writes_disabled

    def path_for(self, key: str) -> Path:
        """Where the block ``key`` lives (whether or not it exists)."""
        return self.folder / key[:2] / f"{key}{SUFFIX}"

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for the start-up index rebuild; True when it is done."""
        return self._ready.wait(timeout)

    # ------------------------------------------------------------------ lookups

    def contains(self, key: str, fingerprint: str) -> bool:
        """Cheap presence check (no file read once the index is built)."""
        indexed = self.indexed(key, fingerprint)
        return self.path_for(key).is_file() if indexed is None else indexed

    def indexed(self, key: str, fingerprint: str) -> bool | None:
        """Whether the index holds `key` as `fingerprint`'s block; None when only the files can
        tell (the index is not built yet). No file I/O: callers may hold the lock."""
        if not self.enabled or not is_key(key):
            return False
        with self._lock:
            entry = self._index.get(key)
            if entry is not None:
                return entry.fingerprint == fingerprint
            return False if self._ready.is_set() else None

    def touch_many(self, keys: list[str]) -> None:
        """Mark blocks used (in this order) that were served from a faster tier, so the budget
        evicts what nobody uses rather than what is used from memory. In the index only: file
        times, the order after a restart, move when a block is read."""
        with self._lock:
            for key in keys:
                self._index.touch(key)

    def get(self, key: str, fingerprint: str, part: str = ALL) -> CacheBlock | None:
        """Load and verify one block (or its `ssd_format` part) as MLX arrays (model's thread); None on a
        miss or on any problem with the file, which is then deleted and counted in ``discarded``."""
        read = self._read(key, fingerprint, part=part)
        return read.to_block() if read is not None else None

    def get_many(self, keys: Sequence[str], fingerprint: str, part: str = ALL) -> list[CacheBlock | None]:
        """``get`` for several keys: files read and verified in parallel (no MLX on the
        reader threads), arrays made here; results in the order of ``keys``."""
        reads = self._reads.map(lambda k: self._read(k, fingerprint, part=part), keys)
        return [r.to_block() if r is not None else None for r in reads]

    def read_ahead(self, keys: Sequence[str], fingerprint: str, part: str = ALL) -> list[Future[TimedRead]]:
        """Start reading and verifying blocks (bytes only) on threads of their own, so that
        `get_many` never queues behind them; each future gives a `TimedRead` (block None as `get`)."""
        return self._reads.ahead(keys, lambda k: self._timed_read(k, fingerprint, part=part), shared=True)

    def read_unmarked(self, keys: Sequence[str], fingerprint: str) -> list[Future[TimedRead]]:
        """`read_ahead` for a measurement of this disk (`PrefixCache.probe_idle`): the same
        threads, reads and checks, but nothing counted as a hit and no block marked as used,
        so a timing leaves the LRU order and the statistics as they were."""
        return self._reads.ahead(keys, lambda k: self._timed_read(k, fingerprint, False), shared=False)

    def _timed_read(self, key: str, fingerprint: str, mark: bool = True, part: str = ALL) -> TimedRead:
        tic = time.perf_counter()
        block = self._read(key, fingerprint, mark, part)
        return TimedRead(block, tic, time.perf_counter())

    def recent_keys(self, fingerprint: str, n: int) -> list[str]:
        """Up to `n` keys of `fingerprint`'s blocks, the most recently used first (none until
        the index is built)."""
        out: list[str] = []
        if n <= 0 or not self._ready.is_set():
            return out
        with self._lock:
            return self._index.recent(fingerprint, n)

    @property
    def block_count(self) -> int:
        """Blocks in the index (of every model)."""
        with self._lock:
            return len(self._index)

    def _read(self, key: str, fingerprint: str, mark: bool = True, part: str = ALL) -> HostBlock | None:
        """`mark`: count the hit or miss and mark the block used (a request's read); `part`: what of it."""
        if not self.enabled or not is_key(key):
            return None
        path = self.path_for(key)
        with self._lock:
            entry = self._index.get(key)
            if entry is None and self._ready.is_set():
                self._counters["misses"] += mark
                return None
        try:
            read, size = self._load(path, key, fingerprint, part)
        except FileNotFoundError:
            self._forget(key)
            with self._lock:
                self._counters["misses"] += mark
            return None
        except Exception as exc:  # noqa: BLE001 - the reader threads' boundary: never raise to the caller
            self._discard(key, path, exc)
            with self._lock:
                self._counters["misses"] += mark
            return None
        if not mark:
            return read
        try:
            os.utime(path)
        except OSError:
            pass
        with self._lock:
            self._counters["hits"] += 1
            indexed = key in self._index
            self._index.touch(key)
        if indexed or (self._ready.is_set() and not path.exists()):  # stat outside the lock: gone since read
            return read
        with self._lock:
            if key not in self._index:
                self._index.add(key, size, fingerprint)
        return read

    def _load(self, path: Path, key: str, fingerprint: str, part: str = ALL) -> tuple[HostBlock, int]:
        """Read a block file (or a part of it) and verify it (`ssd_format.load_block`); tests replace this."""
        return load_block(path, key, fingerprint, part)

    # ------------------------------------------------------------------ writes

    def writing(self, key: str) -> bool:
        """Whether `key` is queued or being written (its bytes are still to be read)."""
        return bool(self.directory.state(key) & Residency.WRITING)

    def has_room(self) -> bool:
        """Whether the write queue is under half full: callers that can hold blocks back
        (the prefix cache's write-back) wait rather than have `put` drop them."""
        return self._queue.qsize() < max(1, self._queue.maxsize // 2)

    def put(self, block: CacheBlock | HostBlock) -> bool:
        """Queue ``block`` for writing (a ``CacheBlock`` is viewed as bytes here, so the writer
        never runs MLX); True when queued. Never blocks on I/O: with the queue full the write
        is dropped and counted in ``dropped_writes``; a block stored or queued is skipped."""
        if block.partial:  # without its state (a KV-only read): never its key's file
            raise ValueError(f"block {block.key[:12]} holds only part of its tensors")
        if not self.enabled or self._closed or not is_key(block.key):
            return False
        with self._lock:
            if self._writes_disabled:
                self._counters["dropped_writes"] += 1
                return False
            if self.directory.state(block.key) & (Residency.SSD | Residency.WRITING):  # indexed or pending
                return False
            if block.nbytes > self._max_bytes:
                self._counters["dropped_writes"] += 1
                return False
            self.directory.mark(block.key, Residency.WRITING)
            self._inflight += 1
        # the only MLX work of a write, on the caller's thread
        item = block if isinstance(block, HostBlock) else HostBlock.of(block, copy=False)
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            with self._lock:
                self.directory.unmark(block.key, Residency.WRITING)
                self._counters["dropped_writes"] += 1
                self._done_one()
            return False
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is done (or dropped); True when drained."""
        with self._idle:
            return self._idle.wait_for(lambda: self._inflight == 0, timeout)

    def _done_one(self) -> None:
        # caller holds self._lock
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.notify_all()

    def _write_file(self, path: Path, host: HostTensors, metadata: dict[str, str]) -> None:
        """Write and fsync one temp file. Tests replace this on the instance to fake I/O errors."""
        with open(path, "wb") as f:  # Python I/O, so a full disk is a plain OSError(ENOSPC)
            write_block(f, host, metadata)
            f.flush()
            os.fsync(f.fileno())

    def _write_one(self, block: HostBlock) -> None:
        if self._writes_disabled:
            with self._lock:
                self._counters["dropped_writes"] += 1
            return
        with self._lock:
            if block.key in self._index:
                return
        final = self.path_for(block.key)
        tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}-{next(_tmp_counter)}")
        log.debug("SSD cache: writing block %s as %s", block.key, tmp.name)
        metadata = block_metadata(block)
        with self._io_lock:
            try:
                final.parent.mkdir(parents=True, exist_ok=True)
                self._write_file(tmp, block.host, metadata)
                os.replace(tmp, final)
                fsync_dir(final.parent)
                size = final.stat().st_size
            except Exception as exc:  # noqa: BLE001 - the writer thread must survive
                unlink(tmp)
                self._write_failed(block.key, exc)
                return
            with self._lock:  # added and the budget restored in one step: no reader sees it exceeded
                self._index.add(block.key, size, block.fingerprint)  # replaces one a hit raced in
                self._counters["writes"] += 1
                evicted = self._over_budget()
            for key in evicted:
                unlink(self.path_for(key))

    def _write_failed(self, key: str, exc: BaseException) -> None:
        with self._lock:
            self._counters["write_errors"] += 1
            first = not self._writes_disabled
            if isinstance(exc, OSError) or looks_like_io_error(exc):
                self._writes_disabled = True
        if self._writes_disabled:
            if first:
                log.warning(
                    "SSD cache: writing block %s to %s failed (%s); SSD cache writes are "
                    "disabled until restart, reads continue",
                    key[:12],
                    self.folder,
                    exc,
                )
            self._drain_queue(count_as_dropped=True)
        else:
            log.warning("SSD cache: could not write block %s: %r", key[:12], exc)

    def _drain_queue(self, *, count_as_dropped: bool) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is None:  # keep the stop sentinel for the writer loop
                self._queue.put_nowait(None)
                return
            with self._lock:
                self.directory.unmark(item.key, Residency.WRITING)
                if count_as_dropped:
                    self._counters["dropped_writes"] += 1
                self._done_one()

    def _evict(self) -> None:
        """Delete least recently used files until the byte budget holds."""
        with self._lock:
            evicted = self._over_budget()
        for key in evicted:
            unlink(self.path_for(key))

    def _over_budget(self) -> list[str]:
        """Take the least recently used entries out of the index until the byte budget holds (under
        `_lock`); their files are the caller's to delete."""
        evicted = []
        while self._index.bytes > self._max_bytes and self._index:
            key, _ = self._index.pop_oldest()
            self._counters["evictions"] += 1
            evicted.append(key)
        return evicted

    # ------------------------------------------------------------------ writer thread

    def hold_writes(self, holder: object, on: bool) -> None:
        """While any holder is on, the writer starts no new file (a lone prefill's TTFT), for at
        most `HOLD_MAX_S` (docs/design/write-back.md)."""
        with self._lock:
            if on:
                self._holders.add(holder)
            else:
                self._holders.discard(holder)
                if not self._holders:
                    self._unheld.notify_all()

    def _wait_unheld(self) -> None:
        with self._lock:
            self._unheld.wait_for(lambda: not self._holders or self._closed, timeout=HOLD_MAX_S)

    def _run(self) -> None:
        lower_thread_priority()
        try:
            self._scan()
            with self._io_lock:
                self._evict()  # the budget may have shrunk since the last run
            with self._lock:
                blocks, nbytes = len(self._index), self._index.bytes
                discarded, stale = self._counters["discarded"], self._counters["stale_tmp_removed"]
            log.info(
                "SSD cache: index of %s loaded: %d blocks (%d bytes); %d unreadable files discarded, "
                "%d stale temp files removed",
                self.folder, blocks, nbytes, discarded, stale,
            )  # fmt: skip
        except Exception:  # noqa: BLE001 - a failed scan leaves an empty index, not a crash
            log.exception("SSD cache: index rebuild of %s failed", self.folder)
        finally:
            self._ready.set()
        while True:
            block = self._queue.get()
            if block is None:
                return
            try:
                self._wait_unheld()
                self._write_one(block)
            except Exception:  # noqa: BLE001 - pragma: no cover - belt and braces
                log.exception("SSD cache: writer error")
            finally:
                with self._lock:
                    self.directory.unmark(block.key, Residency.WRITING)
                    self._done_one()
            del block  # its bytes go now, not when the next block comes (an engine empties MLX's cache)

    def _scan(self) -> None:
        """Rebuild the index from file headers (no tensor data is read)."""
        found = scan_files(self.folder, self._count_stale_tmp, self._discard)
        with self._lock:
            self._index.rebuild(found, self._scan_removed)
            self._scan_removed.clear()

    # ------------------------------------------------------------------ maintenance

    def _count_stale_tmp(self) -> None:
        with self._lock:
            self._counters["stale_tmp_removed"] += 1

    def _forget(self, key: str) -> None:
        with self._lock:
            self._index.pop(key)

    def _discard(self, key: str, path: Path, reason: BaseException) -> None:
        log.warning("SSD cache: discarding %s: %s", path.name, reason)
        unlink(path)
        with self._lock:
            self._forget(key)
            if not self._ready.is_set():
                self._scan_removed.add(key)
            self._counters["discarded"] += 1

    def clear(self) -> None:
        """Delete every block (and pending write) of this tier; counters are kept."""
        if not self.enabled:
            return
        self._ready.wait()
        with self._io_lock:
            self._drain_queue(count_as_dropped=False)
            with self._lock:
                self._index.clear()
            for sub in os.scandir(self.folder):
                if not (sub.is_dir(follow_symlinks=False) and len(sub.name) == 2):
                    continue
                for ent in os.scandir(sub.path):
                    if ent.name.endswith(SUFFIX) or TMP_MARK in ent.name:
                        unlink(ent.path)

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish queued writes (up to ``timeout``), stop the writer and the read pool."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._unheld.notify_all()  # a held writer finishes the queue now
        if self._thread is not None:
            self.flush(timeout)
            self._drain_queue(count_as_dropped=True)
            self._queue.put(None)
            self._thread.join(timeout)
        self._reads.close()

    def __enter__(self) -> SSDTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {
                "blocks": len(self._index),
                "bytes": self._index.bytes,
                "max_bytes": self._max_bytes,
                **self._counters,
                "queue_depth": self._queue.qsize(),
                "writes_disabled": self._writes_disabled,
                "index_ready": self._ready.is_set(),
            }
        return out


