"""A read-ahead's SSD reads judged again while they run, by the plan's own estimate and
`decide.keeps_reading`, and cut short once the rest would restore slower than it recomputes
(docs/design/restore-or-recompute.md, "When the estimate is wrong"). No MLX; any thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from omlx.cache.plan.decide import keeps_reading

# Once this share of recomputing the whole run has passed, the reads are judged on whatever has
# finished (nothing finished: the disk is stalled), so a wrong estimate costs at most about this
# share of the recompute time before the request goes on; but never before twice the time the
# estimate gave the first reads, so that a short run is not judged before any read could finish.
CUT_SHARE = 0.1
FIRST_READS_SLACK = 2.0


def finished_read(future: Future[Any]) -> Any | None:
    """A read-ahead's `TimedRead` when it finished with a block, else None (running, cancelled,
    failed, or nothing read)."""
    if not future.done() or future.cancelled() or future.exception() is not None:
        return None
    read = future.result()
    return read if read.block is not None else None


class ReadWatch:
    """One read-ahead of `len(futures)` blocks of `block_bytes`: `recompute_rest[k]` is what recomputing
    blocks k.. adds, `expected_rate` the rate it was judged on, `upload_rate` that of moving bytes to the
    device (None: free). Judged once `workers` reads finish or at the deadline; a cut calls `on_cut`."""

    def __init__(
        self,
        futures: Sequence[Future[Any]],
        block_bytes: int,
        recompute_rest: Sequence[float],
        *,
        workers: int,
        expected_rate: float | None = None,
        upload_rate: float | None = None,
        on_cut: Callable[[], None] = lambda: None,
        start: float | None = None,
    ) -> None:
        self.futures = list(futures)
        self.block_bytes = max(1, block_bytes)
        self.recompute_rest = list(recompute_rest)
        self.workers = max(1, workers)
        self.upload_rate = upload_rate
        self.on_cut = on_cut
        self.start = time.perf_counter() if start is None else start
        first = min(self.workers, len(self.futures)) * self.block_bytes / expected_rate if expected_rate else 0.0
        self.deadline = max(CUT_SHARE * self.recompute_rest[0], FIRST_READS_SLACK * first)  # seconds after `start`
        self.cut = False
        self.cut_after = 0.0  # seconds from `start` to the cut
        self.read_bytes = 0  # bytes the finished reads held when cut
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def begin(self) -> None:
        """Judge as each read finishes, and at the deadline even if none does."""
        for future in self.futures:
            future.add_done_callback(lambda _: self.check())
        if self.deadline > 0 and not self.cut and not all(f.done() for f in self.futures):
            self._timer = threading.Timer(self.deadline, self.check)
            self._timer.daemon = True
            self._timer.start()

    def check(self, now: float | None = None) -> bool:
        """Judge the reads so far (any thread); True when this call cut them."""
        with self._lock:
            if self.cut:
                return False
            elapsed = (time.perf_counter() if now is None else now) - self.start
            reads = [finished_read(f) for f in self.futures]
            done = sum(r is not None for r in reads)
            failed = sum(f.done() and r is None for f, r in zip(self.futures, reads, strict=True))
            left = len(reads) - done - failed
            if not left:
                self._stop_timer()
                return False
            if done < min(self.workers, len(reads)) and elapsed < self.deadline:
                return False  # too early to tell
            nbytes = sum(r.block.nbytes for r in reads if r is not None)
            kept = next((i for i, r in enumerate(reads) if r is None), len(reads))
            if not self.slower_than_recompute(elapsed, nbytes, left, kept):
                return False
            self.cut, self.cut_after, self.read_bytes = True, elapsed, nbytes
            self._stop_timer()
        for future in reversed(self.futures):  # outside the lock: a cancel runs the callbacks here
            future.cancel()
        self.on_cut()
        return True

    def slower_than_recompute(self, elapsed: float, nbytes: int, left: int, kept: int) -> bool:
        """Whether reading `left` more blocks at the rate so far (`nbytes` in `elapsed` s) and moving
        them to the device takes longer than recomputing from block `kept` on."""
        if nbytes <= 0:
            return elapsed > 0
        rest = left * self.block_bytes
        seconds = rest * elapsed / nbytes + (rest / self.upload_rate if self.upload_rate else 0.0)
        return not keeps_reading(seconds, self.recompute_rest[min(kept, len(self.recompute_rest) - 1)])

    def close(self) -> None:
        """Stop the deadline's timer (the read-ahead was taken or dropped)."""
        with self._lock:
            self._stop_timer()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
