"""The SSD tier's reader threads: a pool for reads a caller waits on and another for reads
ahead, so the first never queue behind the second; bytes and hashing only, no MLX."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from omlx.cache.block.block import HostBlock


class TimedRead(NamedTuple):
    """A block read ahead (`SSDTier.read_ahead`), with when its read began and ended."""

    block: HostBlock | None
    started: float
    finished: float


class ReadPools:
    """Two thread pools made on first use; once closed, reads ahead give `TimedRead`s of None."""

    def __init__(self, workers: int) -> None:
        self.workers = max(1, int(workers))
        # reentrant: a read done before `add_done_callback` runs its callback (which takes the
        # lock) in the thread that added it, with the lock held
        self._lock = threading.RLock()
        self._closed = False
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._ahead: dict[str, Future[TimedRead]] = {}  # reads ahead in flight, by key

    def _pool(self, name: str) -> ThreadPoolExecutor | None:
        with self._lock:
            if self._closed:
                return None
            pool = self._pools.get(name)
            if pool is None:
                pool = self._pools[name] = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="omlx-ssd-read")
            return pool

    def map(self, read: Callable[[str], HostBlock | None], keys: Sequence[str]) -> list[HostBlock | None]:
        """`read` of each key, in parallel where there are several, in the order of `keys`."""
        pool = self._pool("inline") if len(keys) > 1 and self.workers > 1 else None
        if pool is None:
            return [read(k) for k in keys]
        return list(pool.map(read, keys))

    def ahead(self, keys: Sequence[str], read: Callable[[str], TimedRead], *, shared: bool) -> list[Future[TimedRead]]:
        """Start `read` of each key on the read-ahead pool; `shared`: a key already being
        read ahead (for another request) is read once."""
        pool = self._pool("ahead")
        if pool is None:
            return none_read(keys)
        if not shared:
            return [pool.submit(read, key) for key in keys]

        def forget(key: str, future: Future[TimedRead]) -> None:
            with self._lock:
                if self._ahead.get(key) is future:
                    del self._ahead[key]

        futures = []
        with self._lock:
            for key in keys:
                future = self._ahead.get(key)
                if future is None:
                    future = self._ahead[key] = pool.submit(read, key)
                    future.add_done_callback(lambda f, k=key: forget(k, f))
                futures.append(future)
        return futures

    def close(self) -> None:
        """Finish the reads under way and stop the threads."""
        with self._lock:
            self._closed = True
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.shutdown(wait=True)


def none_read(keys: Sequence[str]) -> list[Future[TimedRead]]:
    """Finished reads that found nothing (a closed tier)."""
    done: list[Future[TimedRead]] = [Future() for _ in keys]
    for f in done:
        f.set_result(TimedRead(None, 0.0, 0.0))
    return done
