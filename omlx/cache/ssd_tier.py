"""SSD (cold) tier: one safetensors file per block, written in the background, LRU-evicted.

Why this shape:
- One self-describing file per block (``<dir>/<2 hex>/<key>.safetensors``) makes the
  directory itself the index: it can be rebuilt after any crash by reading file headers,
  and a bad file only ever costs one block.
- Writes never run on the caller's thread (the engine or the event loop): a daemon writer
  drains a bounded queue and, when it is full, drops the write rather than block decode.
- Crash safety comes from the file system: write a temp file, fsync it, ``os.replace``
  it into place, fsync the directory. A reader therefore sees a complete file or none;
  anything else (torn sector, bit rot, a file from another model) is caught by the
  header/size check and the checksum, deleted and counted -- never served, never fatal.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import queue
import re
import struct
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from safetensors import TensorSpec, serialize

from omlx.cache.block import CacheBlock, HostBlock, HostTensors, checksum_host, checksum_matches

__all__ = ["SSDTier", "TimedRead", "FORMAT_VERSION", "read_header", "CorruptBlockFile"]

log = logging.getLogger(__name__)

# "2": a block's tensors may be all layers stacked as one (`kv_layout.KV_STACK`); builds
# that know only "1" (a tensor per layer) discard such files rather than serve them wrong.
FORMAT_VERSION = "2"
READABLE_FORMATS = ("1", "2")
_SUFFIX = ".safetensors"
_TMP_MARK = ".safetensors.tmp-"
_MAX_HEADER = 64 << 20  # no sane block header is anywhere near this
HOLD_MAX_S = 10.0  # the longest the writer waits for `hold_writes` holders before writing anyway
_HEX = frozenset("0123456789abcdef")
_tmp_counter = itertools.count()  # process-wide, so two tiers never pick the same temp name


class CorruptBlockFile(Exception):
    """A block file that must not be served (truncated, unparsable, mismatching)."""


class TimedRead(NamedTuple):
    """A block read ahead (`SSDTier.read_ahead`), with when its read began and ended."""

    block: HostBlock | None
    started: float
    finished: float


@dataclass
class _Entry:
    size: int
    fingerprint: str


_KEY = re.compile(r"[0-9a-f]{64}")


def _is_key(text: str) -> bool:
    """A block key (64 lowercase hex digits). Asked on every presence check, up to 255 times
    in a lookup's tail search: a regex, not a check char by char (3-15 µs each here)."""
    return _KEY.fullmatch(text) is not None


def read_header(path: Path | str, file_size: int | None = None) -> dict[str, str]:
    """The ``__metadata__`` of a block file, after checking the file is whole.

    Reads only the 8-byte length and the JSON header, never tensor data, and checks that
    the file is exactly as long as the header's data offsets say (catches truncation and
    appended garbage). Raises ``CorruptBlockFile``; ``FileNotFoundError`` passes through.
    """
    with open(path, "rb") as f:
        if file_size is None:
            file_size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = _header_length(head, file_size)
        raw = f.read(n)
    return _parse_header(raw, n, file_size)[0]


def _header_length(head: bytes, file_size: int) -> int:
    if len(head) != 8:
        raise CorruptBlockFile("shorter than the safetensors length prefix")
    (n,) = struct.unpack("<Q", head)
    if n == 0 or n > _MAX_HEADER or 8 + n > file_size:
        raise CorruptBlockFile(f"bad header length {n} for a {file_size}-byte file")
    return n


def _parse_header(raw: bytes, n: int, file_size: int) -> tuple[dict[str, str], dict[str, Any]]:
    """(metadata, tensor entries) of a block file's JSON header, validated against its size."""
    if len(raw) != n:
        raise CorruptBlockFile("truncated header")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptBlockFile(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptBlockFile("header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict):
        raise CorruptBlockFile("no __metadata__ in header")
    end = 0
    for name, info in header.items():
        try:
            start, stop = info["data_offsets"]
            start, stop = int(start), int(stop)
        except (KeyError, TypeError, ValueError):
            raise CorruptBlockFile(f"bad data_offsets for {name!r}") from None
        if not 0 <= start <= stop:
            raise CorruptBlockFile(f"bad data_offsets for {name!r}")
        end = max(end, stop)
    if 8 + n + end != file_size:
        raise CorruptBlockFile(f"size {file_size} != {8 + n + end} announced by the header")
    if meta.get("format_version") not in READABLE_FORMATS:
        raise CorruptBlockFile(f"unknown format_version {meta.get('format_version')!r}")
    for field in ("key", "fingerprint", "checksum", "token_count", "layer_types"):
        if not isinstance(meta.get(field), str):
            raise CorruptBlockFile(f"metadata field {field!r} missing")
    return meta, header


# safetensors dtype codes of the tensors a block can hold, as MLX dtype names
_ST_DTYPES = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
    "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
    "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool",
}  # fmt: skip


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:  # pragma: no cover
        return False
    return True


def _unlink(path: Path | str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # pragma: no cover - e.g. read-only file system
        log.debug("could not delete %s: %s", path, exc)


def _lower_thread_priority() -> None:
    """Writes are background work: on Linux (per-thread nice) they yield the CPU to decoding,
    which matters on small machines where checksumming and writing compete with the engine."""
    if sys.platform != "linux":
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except OSError:
        pass


class SSDTier:
    """Persistent block store under ``cache_dir`` with an LRU byte budget.

    ``max_bytes == 0`` disables the tier (no directory is touched, no thread started).
    The index is rebuilt from file headers on the writer thread, so start-up never waits
    for it; until it is done, lookups fall back to the file system (paths are derived from
    keys). One ``SSDTier`` per directory per process.
    """

    def __init__(
        self,
        cache_dir: Path,
        max_bytes: int,
        *,
        write_queue_max: int = 256,
        read_workers: int = 4,
    ) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self._dir = Path(cache_dir)
        self._max_bytes = int(max_bytes)
        self._read_workers = max(1, int(read_workers))
        self._lock = threading.RLock()  # index, counters, pending
        self._io_lock = threading.Lock()  # one writer of files at a time (writer vs clear)
        self._index: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._ready = threading.Event()
        self._scan_removed: set[str] = set()
        self._queue: queue.Queue[CacheBlock | None] = queue.Queue(maxsize=max(1, write_queue_max))
        self._pending: set[str] = set()
        self._inflight = 0
        self._idle = threading.Condition(self._lock)
        # engines prefilling a prompt alone (`hold_writes`): the writer waits between files
        self._holders: set[object] = set()
        self._unheld = threading.Condition(self._lock)
        self._pool: ThreadPoolExecutor | None = None  # `get_many`'s readers
        self._ahead_pool: ThreadPoolExecutor | None = None  # `read_ahead`'s
        self._ahead: dict[str, Future[TimedRead]] = {}  # reads ahead in flight, by key
        self._closed = False
        self._writes_disabled = False
        self._counters = dict.fromkeys(
            (
                "hits",
                "misses",
                "writes",
                "write_errors",
                "dropped_writes",
                "evictions",
                "discarded",
                "stale_tmp_removed",
            ),
            0,
        )
        self._thread: threading.Thread | None = None
        if self._max_bytes > 0:
            self._dir.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._run, name="omlx-ssd-writer", daemon=True)
            self._thread.start()
        else:
            self._ready.set()

    # ------------------------------------------------------------------ properties

    @property
    def enabled(self) -> bool:
        return self._max_bytes > 0

    @property
    def cache_dir(self) -> Path:
        return self._dir

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    @property
    def writes_disabled(self) -> bool:
        return self._writes_disabled

    @property
    def directory(self) -> Path:
        return self._dir

    def path_for(self, key: str) -> Path:
        """Where the block ``key`` lives (whether or not it exists)."""
        return self._dir / key[:2] / f"{key}{_SUFFIX}"

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for the start-up index rebuild; True when it is done."""
        return self._ready.wait(timeout)

    # ------------------------------------------------------------------ lookups

    def contains(self, key: str, fingerprint: str) -> bool:
        """Cheap presence check (no file read once the index is built)."""
        if not self.enabled or not _is_key(key):
            return False
        with self._lock:
            entry = self._index.get(key)
            if entry is not None:
                return entry.fingerprint == fingerprint
            if self._ready.is_set():
                return False
        return self.path_for(key).is_file()

    def touch_many(self, keys: list[str]) -> None:
        """Mark blocks used (in this order) that were served from a faster tier, so the budget
        evicts what nobody uses rather than what is used from memory. In the index only: file
        times, the order after a restart, move when a block is read."""
        with self._lock:
            for key in keys:
                if key in self._index:
                    self._index.move_to_end(key)

    def get(self, key: str, fingerprint: str) -> CacheBlock | None:
        """Load and verify one block; ``None`` on a miss or on any problem with the file.

        A file that fails verification is deleted and counted in ``discarded``. The
        returned tensors are evaluated arrays, ready to be handed to a model. Call on the
        thread that owns the model: this is where the bytes become MLX arrays.
        """
        read = self._read(key, fingerprint)
        return read.to_block() if read is not None else None

    def get_many(self, keys: Sequence[str], fingerprint: str) -> list[CacheBlock | None]:
        """``get`` for several keys: files read and verified in parallel (no MLX on the
        reader threads), arrays made here; results in the order of ``keys``."""
        pool = self._reader_pool("_pool") if len(keys) > 1 and self._read_workers > 1 else None
        if pool is None:
            reads = [self._read(k, fingerprint) for k in keys]
        else:
            reads = list(pool.map(lambda k: self._read(k, fingerprint), keys))
        return [r.to_block() if r is not None else None for r in reads]

    def read_ahead(self, keys: Sequence[str], fingerprint: str) -> list[Future[TimedRead]]:
        """Start reading and verifying blocks (bytes only) on threads of their own, so that
        `get_many` never queues behind them; each future gives a `TimedRead`, its block None
        as `get` would. For a caller with other work to do meanwhile: the engine keeps
        decoding while a request's prefix comes off the disk."""
        pool = self._reader_pool("_ahead_pool")
        if pool is None:  # closed
            return self._none_read(keys)

        def forget(key: str, future: Future[TimedRead]) -> None:
            with self._lock:
                if self._ahead.get(key) is future:
                    del self._ahead[key]

        futures = []
        with self._lock:  # a block already being read ahead (for another request) is read once
            for key in keys:
                future = self._ahead.get(key)
                if future is None:
                    future = self._ahead[key] = pool.submit(self._timed_read, key, fingerprint)
                    future.add_done_callback(lambda f, k=key: forget(k, f))
                futures.append(future)
        return futures

    def read_unmarked(self, keys: Sequence[str], fingerprint: str) -> list[Future[TimedRead]]:
        """`read_ahead` for a measurement of this disk (`PrefixCache.probe_idle`): the same
        threads, reads and checks, but nothing counted as a hit and no block marked as used,
        so a timing leaves the LRU order and the statistics as they were."""
        pool = self._reader_pool("_ahead_pool")
        if pool is None:  # closed
            return self._none_read(keys)
        return [pool.submit(self._timed_read, key, fingerprint, False) for key in keys]

    def _timed_read(self, key: str, fingerprint: str, mark: bool = True) -> TimedRead:
        tic = time.perf_counter()
        block = self._read(key, fingerprint, mark)
        return TimedRead(block, tic, time.perf_counter())

    @staticmethod
    def _none_read(keys: Sequence[str]) -> list[Future[TimedRead]]:
        done: list[Future[TimedRead]] = [Future() for _ in keys]
        for f in done:
            f.set_result(TimedRead(None, 0.0, 0.0))
        return done

    def recent_keys(self, fingerprint: str, n: int) -> list[str]:
        """Up to `n` keys of `fingerprint`'s blocks, the most recently used first (none until
        the index is built)."""
        out: list[str] = []
        if n <= 0 or not self._ready.is_set():
            return out
        with self._lock:
            for key in reversed(self._index):
                if self._index[key].fingerprint == fingerprint:
                    out.append(key)
                    if len(out) == n:
                        break
        return out

    @property
    def block_count(self) -> int:
        """Blocks in the index (of every model)."""
        with self._lock:
            return len(self._index)

    def _reader_pool(self, name: str) -> ThreadPoolExecutor | None:
        """The pool in attribute `name`, made on first use; None once the tier is closed."""
        with self._lock:
            if self._closed:
                return None
            pool = getattr(self, name)
            if pool is None:
                pool = ThreadPoolExecutor(max_workers=self._read_workers, thread_name_prefix="omlx-ssd-read")
                setattr(self, name, pool)
            return pool

    def _read(self, key: str, fingerprint: str, mark: bool = True) -> HostBlock | None:
        """`mark`: count the hit or miss and mark the block used (a request's read)."""
        if not self.enabled or not _is_key(key):
            return None
        path = self.path_for(key)
        with self._lock:
            entry = self._index.get(key)
            if entry is None and self._ready.is_set():
                self._counters["misses"] += mark
                return None
        try:
            read, size = self._load(path, key, fingerprint)
        except FileNotFoundError:
            self._forget(key)
            with self._lock:
                self._counters["misses"] += mark
            return None
        except Exception as exc:  # noqa: BLE001 - never raise to the caller
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
            if key in self._index:
                self._index.move_to_end(key)
            elif not self._ready.is_set() or path.exists():
                self._index[key] = _Entry(size, fingerprint)
                self._bytes += size
        return read

    def _load(self, path: Path, key: str, fingerprint: str) -> tuple[HostBlock, int]:
        """Read a whole block file into memory and verify it: bytes and hashing only."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = _header_length(f.read(8), size)
            meta, entries = _parse_header(f.read(n), n, size)  # rejects truncated files early
            _check_identity(meta, key, fingerprint)
            data = f.read()
        if len(data) != size - 8 - n:
            raise CorruptBlockFile("file changed while reading")
        buf = np.frombuffer(data, dtype=np.uint8)
        host: HostTensors = {}
        for name, info in entries.items():
            dt = _ST_DTYPES.get(info.get("dtype"))
            shape = info.get("shape")
            if dt is None or not isinstance(shape, list):
                raise CorruptBlockFile(f"bad dtype or shape for {name!r}")
            start, stop = (int(x) for x in info["data_offsets"])
            tensor = buf[start:stop]
            if tensor.nbytes != int(np.prod(shape, dtype=np.int64)) * np.dtype(
                "uint16" if dt == "bfloat16" else dt
            ).itemsize:
                raise CorruptBlockFile(f"size of {name!r} does not match its shape")
            host[name] = (dt, tuple(int(d) for d in shape), tensor)
        if not checksum_matches(host, meta["checksum"]):
            raise CorruptBlockFile("checksum mismatch")
        try:
            token_count = int(meta["token_count"])
            layer_types = json.loads(meta["layer_types"])
        except (ValueError, json.JSONDecodeError) as exc:
            raise CorruptBlockFile(f"bad metadata: {exc}") from None
        if not isinstance(layer_types, list):
            raise CorruptBlockFile("layer_types is not a list")
        read = HostBlock(
            key=key,
            parent=meta.get("parent") or None,
            fingerprint=fingerprint,
            token_count=token_count,
            layer_types=[str(t) for t in layer_types],
            host=host,
        )
        return read, size

    # ------------------------------------------------------------------ writes

    def writing(self, key: str) -> bool:
        """Whether `key` is queued or being written (its bytes are still to be read)."""
        with self._lock:
            return key in self._pending

    def has_room(self) -> bool:
        """Whether the write queue is under half full: callers that can hold blocks back
        (the prefix cache's write-back) wait rather than have `put` drop them."""
        return self._queue.qsize() < max(1, self._queue.maxsize // 2)

    def put(self, block: CacheBlock | HostBlock) -> bool:
        """Queue ``block`` for writing; True when queued. Never blocks on I/O.

        Skips blocks already stored or queued. A ``CacheBlock``'s tensors are evaluated and
        viewed as bytes here (a no-op when the caller already evaluated them) so the writer
        thread only copies bytes and never runs a graph built on the caller's stream; a
        ``HostBlock`` (bytes already in host memory, e.g. the RAM tier's copy) is queued as
        is. When the queue is full the write is dropped and counted in ``dropped_writes``.
        """
        if not self.enabled or self._closed or not _is_key(block.key):
            return False
        with self._lock:
            if self._writes_disabled:
                self._counters["dropped_writes"] += 1
                return False
            if block.key in self._index or block.key in self._pending:
                return False
            if block.nbytes > self._max_bytes:
                self._counters["dropped_writes"] += 1
                return False
            self._pending.add(block.key)
            self._inflight += 1
        # the only MLX work of a write, on the caller's thread
        item = block if isinstance(block, HostBlock) else HostBlock.of(block, copy=False)
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            with self._lock:
                self._pending.discard(block.key)
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
        specs = {
            name: TensorSpec(dtype=dt, shape=list(shape), data_ptr=data.ctypes.data, data_len=data.nbytes)
            for name, (dt, shape, data) in host.items()
        }  # `host` keeps the buffers alive for the call
        data = serialize(specs, metadata)
        with open(path, "wb") as f:  # Python I/O, so a full disk is a plain OSError(ENOSPC)
            f.write(data)
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
        metadata = {
            "format_version": FORMAT_VERSION,
            "key": block.key,
            "parent": block.parent or "",
            "token_count": str(int(block.token_count)),
            "fingerprint": block.fingerprint,
            "layer_types": json.dumps(list(block.layer_types)),
            "checksum": checksum_host(block.host),
        }
        with self._io_lock:
            try:
                final.parent.mkdir(parents=True, exist_ok=True)
                self._write_file(tmp, block.host, metadata)
                os.replace(tmp, final)
                _fsync_dir(final.parent)
                size = final.stat().st_size
            except Exception as exc:  # noqa: BLE001 - the writer thread must survive
                _unlink(tmp)
                self._write_failed(block.key, exc)
                return
            with self._lock:
                old = self._index.pop(block.key, None)
                if old is not None:  # pragma: no cover - a hit raced in during the write
                    self._bytes -= old.size
                self._index[block.key] = _Entry(size, block.fingerprint)
                self._bytes += size
                self._counters["writes"] += 1
            self._evict()

    def _write_failed(self, key: str, exc: BaseException) -> None:
        with self._lock:
            self._counters["write_errors"] += 1
            first = not self._writes_disabled
            if isinstance(exc, OSError) or _looks_like_io_error(exc):
                self._writes_disabled = True
        if self._writes_disabled:
            if first:
                log.warning(
                    "SSD cache: writing block %s to %s failed (%s); SSD cache writes are "
                    "disabled until restart, reads continue",
                    key[:12],
                    self._dir,
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
                self._pending.discard(item.key)
                if count_as_dropped:
                    self._counters["dropped_writes"] += 1
                self._done_one()

    def _evict(self) -> None:
        """Delete least recently used files until the byte budget holds."""
        while True:
            with self._lock:
                if self._bytes <= self._max_bytes or not self._index:
                    return
                key, entry = self._index.popitem(last=False)
                self._bytes -= entry.size
                self._counters["evictions"] += 1
            _unlink(self.path_for(key))

    # ------------------------------------------------------------------ writer thread

    def hold_writes(self, holder: object, on: bool) -> None:
        """While any holder is on, the writer starts no new file. Serialising and checksumming
        a block takes the GIL and memory bandwidth from an engine thread whose lone prefill is
        all of a request's TTFT; a prefill lasts seconds at most, and `HOLD_MAX_S` bounds the
        wait should a holder never let go."""
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
        _lower_thread_priority()
        try:
            self._scan()
            with self._io_lock:
                self._evict()  # the budget may have shrunk since the last run
            with self._lock:
                blocks, nbytes = len(self._index), self._bytes
                discarded, stale = self._counters["discarded"], self._counters["stale_tmp_removed"]
            log.info(
                "SSD cache: index of %s loaded: %d blocks (%d bytes); %d unreadable files discarded, "
                "%d stale temp files removed",
                self._dir, blocks, nbytes, discarded, stale,
            )  # fmt: skip
        except Exception:  # noqa: BLE001 - a failed scan leaves an empty index, not a crash
            log.exception("SSD cache: index rebuild of %s failed", self._dir)
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
                    self._pending.discard(block.key)
                    self._done_one()
            del block  # its bytes go now, not when the next block comes (an engine empties MLX's cache)

    def _scan(self) -> None:
        """Rebuild the index from file headers (no tensor data is read)."""
        found: list[tuple[int, str, int, str]] = []
        own_pid = os.getpid()
        try:
            subdirs = [e for e in os.scandir(self._dir) if e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return
        for sub in subdirs:
            if len(sub.name) != 2 or not set(sub.name) <= _HEX:
                continue
            try:
                files = list(os.scandir(sub.path))
            except OSError:
                continue
            for ent in files:
                name = ent.name
                if _TMP_MARK in name:
                    if _stale_tmp(name, own_pid):
                        _unlink(ent.path)
                        with self._lock:
                            self._counters["stale_tmp_removed"] += 1
                    continue
                if not name.endswith(_SUFFIX):
                    continue
                key = name[: -len(_SUFFIX)]
                if not _is_key(key) or key[:2] != sub.name:
                    continue
                try:
                    st = ent.stat()
                    meta = read_header(ent.path, st.st_size)
                    if meta["key"] != key:
                        raise CorruptBlockFile("file name and metadata key differ")
                except FileNotFoundError:
                    continue
                except (CorruptBlockFile, OSError) as exc:
                    self._discard(key, Path(ent.path), exc)
                    continue
                found.append((st.st_mtime_ns, key, st.st_size, meta["fingerprint"]))
        found.sort()
        with self._lock:
            rebuilt: OrderedDict[str, _Entry] = OrderedDict()
            for _mtime, key, size, fp in found:
                if key not in self._scan_removed:
                    rebuilt[key] = _Entry(size, fp)
            for key, entry in self._index.items():  # hits during the scan are the newest
                rebuilt.pop(key, None)
                rebuilt[key] = entry
            self._index = rebuilt
            self._bytes = sum(e.size for e in rebuilt.values())
            self._scan_removed.clear()

    # ------------------------------------------------------------------ maintenance

    def _forget(self, key: str) -> None:
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is not None:
                self._bytes -= entry.size

    def _discard(self, key: str, path: Path, reason: BaseException) -> None:
        log.warning("SSD cache: discarding %s: %s", path.name, reason)
        _unlink(path)
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
                self._bytes = 0
            for sub in os.scandir(self._dir):
                if not (sub.is_dir(follow_symlinks=False) and len(sub.name) == 2):
                    continue
                for ent in os.scandir(sub.path):
                    if ent.name.endswith(_SUFFIX) or _TMP_MARK in ent.name:
                        _unlink(ent.path)

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
        with self._lock:
            pools = [self._pool, self._ahead_pool]
            self._pool = self._ahead_pool = None
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=True)

    def __enter__(self) -> SSDTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {
                "blocks": len(self._index),
                "bytes": self._bytes,
                "max_bytes": self._max_bytes,
                **self._counters,
                "queue_depth": self._queue.qsize(),
                "writes_disabled": self._writes_disabled,
                "index_ready": self._ready.is_set(),
            }
        return out


def _check_identity(meta: Mapping[str, str], key: str, fingerprint: str) -> None:
    if meta.get("key") != key:
        raise CorruptBlockFile("metadata key does not match the file's key")
    if meta.get("fingerprint") != fingerprint:
        raise CorruptBlockFile("block belongs to another model fingerprint")


def _stale_tmp(name: str, own_pid: int) -> bool:
    """A temp file is stale unless a live process other than us may still be writing it."""
    try:
        pid = int(name.rsplit(_TMP_MARK, 1)[1].split("-", 1)[0])
    except (IndexError, ValueError):
        return True
    return pid == own_pid or not _pid_alive(pid)


def _looks_like_io_error(exc: BaseException) -> bool:
    """MLX may wrap an OS write error in a RuntimeError; recognise the usual ones."""
    text = str(exc).lower()
    needles = ("no space", "i/o error", "permission denied", "read-only", "disk quota")
    return any(n in text for n in needles) or getattr(exc, "errno", None) in (
        errno.ENOSPC,
        errno.EIO,
        errno.EACCES,
        errno.EPERM,
        errno.EROFS,
        errno.EDQUOT,
    )
