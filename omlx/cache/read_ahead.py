"""Reading a request's cached prefix ahead, off the critical path: its SSD run on the SSD
tier's reader threads, its RAM run moved to device memory a chunk per engine loop.
Mixed into `PrefixCache`. Why and the figures: docs/design/ram-moves.md."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from omlx.cache.block import CacheBlock
from omlx.cache.read_watch import ReadWatch, finished_read
from omlx.cache.restore_model import log_judgement
from omlx.cache.ssd_format import KV_PART

log = logging.getLogger("omlx.cache")

# An SSD run at least this large is read ahead (`PrefixCache.prefetch`) while the engine goes on
# decoding; smaller ones are read in `lookup`, where they stall the other streams only briefly.
PREFETCH_MIN_BYTES = 16 << 20
# A RAM run at least PREFETCH_MIN_BYTES large is moved into device memory by `advance`, this
# much per engine loop (docs/design/ram-moves.md).
RESTORE_CHUNK = 64 << 20


@dataclass(eq=False)
class Prefetch:
    """One request's cached prefix made ready off the critical path (`PrefixCache.prefetch`):
    its SSD run read on reader threads, its RAM run moved to device memory a chunk per engine
    loop while other requests run (else at once: `advance`), deepest block first."""

    keys: list[str]  # the SSD run read ahead
    futures: list[Any]  # of `TimedRead`, in the order of `keys`
    ram_keys: list[str] = field(default_factory=list)  # the RAM run still to move, root first
    first_move: float | None = None  # when `advance` first moved a chunk (with the sums below: the debug log)
    moving_s: float = 0.0
    moved_bytes: int = 0
    chain: frozenset[str] = frozenset()  # the prompt's block keys: moving in evicts none of them
    loops: int = 0
    watch: ReadWatch | None = None  # the SSD reads judged again as they finish (cut short when slow)

    @property
    def needs_engine(self) -> bool:
        """Whether `advance` has work to do on the engine thread (else only reads to wait for)."""
        return bool(self.ram_keys)


def when_all_done(futures: list[Any], on_done: Callable[[], None]) -> None:
    """Call `on_done` (on the thread that finishes it) once the last of `futures` is done."""
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Any) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            on_done()

    for future in futures:
        future.add_done_callback(one_done)


class ReadAhead:
    """`prefetch`, `advance` and `take` of `PrefixCache` (its tiers, keys and restore model)."""

    def prefetch(self, tokens: list[int], on_done: Callable[[], None]) -> Prefetch | None:
        """Make ready off the critical path what `lookup(tokens)` would restore from the slow tiers:
        the SSD run read on the reader threads (`on_done` when over), the RAM run left to `advance`;
        only runs of `PREFETCH_MIN_BYTES` the rates say to restore; None when nothing is to do."""
        ssd, hot, warm = self.tiers.ssd, self.tiers.hot, self.tiers.warm
        if (ssd is None and warm is None) or not self.block_bytes:
            return None
        limit = len(tokens) - 1
        keys = self._prompt_keys(tokens, keep=True)
        start = len(self._run_in(keys, 0, limit, self._in_device_memory))
        ram_run = self._run_in(keys, start, limit, warm.contains) if warm is not None else []
        # judged quietly: `lookup` decides again and logs what it does not find done ahead,
        # so each decision is logged once, here for the runs made ready ahead
        ram_why: tuple[Any, ...] | None = None
        if ram_run:  # a stateful model's is copied in `lookup` (KV-only: cache-kinds.md), never moved ahead
            rate = self.warm_copy_rate if self.by_part else self.warm_rate
            pays, ram_why = self.costs.judge(len(ram_run) * self.B, start * self.B, rate)
            if not pays:
                return None  # `lookup` recomputes from there: no SSD block is used either
        run, ssd_why = [], None
        if ssd is not None and self.ssd_rate.value is not None:
            run = self._run_in(keys, start + len(ram_run), limit, lambda k: ssd.contains(k, self.fp))
        pays = self.costs.restore_bytes(len(run) * self.B) >= PREFETCH_MIN_BYTES
        if pays:
            pays, ssd_why = self.costs.judge(len(run) * self.B, (start + len(ram_run)) * self.B, self.ssd_rate)
        if not pays:
            run = []
        block_bytes = self.block_bytes
        if self.by_part or self.warm_rate.value is None or len(ram_run) * block_bytes < PREFETCH_MIN_BYTES:
            ram_run = []  # unmeasured: `lookup` times a part of it first; small: in line is fine
        # no more than half the hot tier: moved deepest first, a larger run would push its own
        # deep blocks out again before `lookup`, which copies the rest in line
        ram_run = ram_run[: max(0, hot.max_bytes // 2 // max(1, block_bytes))]
        if not run and not ram_run:
            return None
        futures: list[Any] = []
        if run:
            try:
                futures = ssd.read_ahead(run, self.fp, part=KV_PART) if self.by_part else ssd.read_ahead(run, self.fp)
            except RuntimeError:  # its reader threads were stopped: `lookup` reads in line then
                log.exception("reading prefix-cache blocks of %s ahead failed", self.model_id)
                run = []
        if not run and not ram_run:
            return None
        log_judgement(ram_why if ram_run else None)
        log_judgement(ssd_why if run else None)
        when_all_done(futures, on_done)
        watch = self._watch(futures, (start + len(ram_run)) * self.B, on_done) if futures else None
        return Prefetch(run, futures, ram_run, chain=frozenset(keys), watch=watch)

    def _watch(self, futures: list[Any], depth: int, on_done: Callable[[], None]) -> ReadWatch | None:
        """A `ReadWatch` over the SSD reads of a run `depth` tokens in (None while recomputing it
        cannot be estimated): a read-ahead judged on a wrong rate is cut short, not waited out."""
        B = self.B
        rest = [self.prefill.seconds((len(futures) - k) * B, depth + k * B) for k in range(len(futures) + 1)]
        if any(s is None for s in rest):
            return None
        watch = ReadWatch(
            futures, self.costs.bytes_per_token * B if self.by_part else self.block_bytes, rest,
            workers=self.tiers.ssd.read_workers, expected_rate=self.ssd_rate.value, upload_rate=self.warm_rate.value,
            on_cut=on_done,
        )  # fmt: skip
        watch.begin()
        return watch

    def advance(self, prefetched: Prefetch, move: bool, alone: bool = False) -> bool:
        """Engine thread, once per loop: with `move`, up to `RESTORE_CHUNK` bytes of the RAM run
        into device memory, deepest first (all of it when `alone`: docs/design/ram-moves.md); True
        once the whole prefetch is ready for `take` and `lookup`."""
        if move and prefetched.ram_keys:
            tic = time.perf_counter()
            moved: list[CacheBlock] = []
            size = 0
            hot = self.tiers.hot
            while prefetched.ram_keys and (alone or size < RESTORE_CHUNK):
                key = prefetched.ram_keys[-1]
                if self._in_device_memory(key):  # another request moved it
                    prefetched.ram_keys.pop()
                    continue
                block = self._from_warm(key, move=True)  # the run fits in half the hot tier
                if block is None:  # RAM let it go: `lookup` restores what is left, or recomputes
                    prefetched.ram_keys.clear()
                    break
                prefetched.ram_keys.pop()
                moved.append(block)
                size += block.nbytes
            if moved:
                # a device operation over every array: on CUDA their first device use migrates
                # them, part of what a restore from RAM costs (and what `lookup` times too)
                mx.eval([t.sum() for b in moved for t in b.tensors.values()])
                self.tiers.moved_in(size)
                for block in moved:
                    hot.put(block, keep=prefetched.chain)
                toc = time.perf_counter()
                self.warm_rate.observe(size, toc - tic)
                self._save_costs()
                if prefetched.first_move is None:
                    prefetched.first_move = tic
                prefetched.moving_s += toc - tic
                prefetched.moved_bytes += size
                prefetched.loops += 1
                if not prefetched.ram_keys:
                    log.debug(
                        "%s: %d bytes moved in from RAM ahead in %d loops: %.3fs moving, %.3fs from the first move",
                        self.model_id, prefetched.moved_bytes, prefetched.loops, prefetched.moving_s,
                        toc - prefetched.first_move,
                    )  # fmt: skip
        cut = prefetched.watch is not None and prefetched.watch.cut
        return not prefetched.ram_keys and (cut or all(f.done() for f in prefetched.futures))

    def take(self, prefetched: Prefetch) -> None:
        """Stage a finished prefetch's blocks for the next `lookup` (up to the first that
        could not be read). A read-ahead cut short for its slowness sets the SSD's rate to what its
        reads showed, and the `lookup` restores what was read and recomputes the rest."""
        self.tiers.directory.unstage_all(self.fp)
        watch = prefetched.watch
        if watch is not None:
            watch.close()
            if watch.cut:
                self._cut_ahead = True
                self.ssd_rate.forget()  # measured at this run's size just now: what it was before is wrong
                self.ssd_rate.observe(max(watch.read_bytes, watch.block_bytes), watch.cut_after)
                self._save_costs(force=True)
                log.info(
                    "%s: the SSD read-ahead was cut short after %.3fs (%d bytes read): slower than recomputing",
                    self.model_id, watch.cut_after, watch.read_bytes,
                )  # fmt: skip
        reads = []
        for future in prefetched.futures:
            read = finished_read(future)
            if read is None:
                break
            self.tiers.directory.stage(read.block)
            reads.append(read)
        self._staged_read_s = 0.0
        if reads:  # from the first read's start to the last one's end (not time queued before)
            seconds = max(r.finished for r in reads) - min(r.started for r in reads)
            self._staged_s_per_byte = seconds / max(1, sum(r.block.nbytes for r in reads))
