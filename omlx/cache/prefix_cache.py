"""The prefix cache as the engine sees it: find, restore and store KV blocks of one model.

Bookkeeping (keys, restore decisions) lives here; the tiers every model shares are
`store.CacheStore`'s, and how blocks hold and rebuild a model's KV cache is `kv_layout`'s.
The engine thread calls `lookup()` before inserting a request into the batch and `store()`
when a sequence's prompt is prefilled and when it finishes. All MLX work here runs on
that engine thread; the SSD writer only writes bytes of evaluated arrays.

Stored blocks go to the hot tier at once and to the SSD writer later (`write_back`):
handing a block over copies it to host memory on the engine thread, which on a CUDA GPU
runs at ~2 GB/s (a 30,000-token prompt of an 8B model: ~2 s during which no stream
decodes). So on a CUDA GPU the copies wait until the engine is idle, or until more than
`WRITE_BACK_BOUND_GPU` bytes wait; elsewhere (unified memory, the copy is cheap) they
follow each step. Either way at most `WRITE_BACK_CHUNK` bytes per engine loop.

Beyond full blocks, each stored sequence also leaves its unfinished tail as a
"partial" block keyed by (parent block, its exact tokens). The next turn of a
conversation extends the previous prompt + answer, so it finds that tail too and
only its new tokens are prefilled — as with token-granular in-RAM caches, but
restartable from the SSD.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from omlx.cache.block import CacheBlock, HostBlock
from omlx.cache.block_hash import (
    block_keys,
    chain_key,
    model_fingerprint,
    tail_keys,
    weights_digest,
)
from omlx.cache.cost_file import CostFile
from omlx.cache.interface import NoCache, PrefixCacheInterface
from omlx.cache.kv_layout import (
    KV_STACK,
    join_blocks,
    layer_tensors,
    sliceable,
    stack_group_bytes,
    stackable,
)
from omlx.cache.model_shapes import attention_ratio
from omlx.cache.restore_model import RestoreModel, Throughput, log_judgement
from omlx.cache.store import CacheStore
from omlx.platform_info import discrete_gpu

log = logging.getLogger("omlx.cache")

MAX_PARENTS = 50_000  # token-level tail index: bounded bookkeeping, ~1 KB per entry
MAX_SIBLINGS = 16
# A partial block alone is restored only from this many tokens: a few shared tokens (a chat
# template's header) save no measurable prefill, yet make the request's prompt length differ
# from its prefill batch-mates', which sends the batch through mlx-lm's padded path.
MIN_TAIL_ONLY_TOKENS = 32
# Blocks that may wait for the SSD in device memory while a CUDA engine is busy (beyond it,
# the oldest are handed over between steps); at most WRITE_BACK_CHUNK bytes per engine loop,
# so a step, or a request arriving at an idle engine, waits for at most that much copying, or
# one block where a block is larger (device -> host ran at ~2.4 GB/s on an H200: 16 MB is
# ~7 ms, 64 MB showed as 30 ms of queue; a 256-token block of an 8B model is 32 MB).
WRITE_BACK_BOUND_GPU = 1 << 30
WRITE_BACK_CHUNK = 16 << 20
# An idle engine times its SSD's restores (`PrefixCache.probe_idle`) on this much of its blocks
# (at least one): a request arriving meanwhile may wait behind these reads on the reader threads.
IDLE_PROBE_BYTES = 32 << 20
# An SSD run at least this large is read ahead (`PrefixCache.prefetch`) while the engine goes on
# decoding; smaller ones are read in `lookup`, where they stall the other streams only briefly.
PREFETCH_MIN_BYTES = 16 << 20
# A RAM run at least PREFETCH_MIN_BYTES large is moved into device memory by `advance`, this
# much per engine loop (~30 ms at the ~2 GB/s of MLX's host -> device copies on CUDA).
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
    loops: int = 0

    @property
    def needs_engine(self) -> bool:
        """Whether `advance` has work to do on the engine thread (else only reads to wait for)."""
        return bool(self.ram_keys)


def _use_on_device(blocks: list[CacheBlock]) -> None:
    """A device operation over every tensor of `blocks`: on a CUDA GPU an array made from host
    bytes reaches device memory only at its first use, part of what a restore costs."""
    by_layout: dict[tuple[str, ...], list[CacheBlock]] = {}  # a chain may mix the two formats
    for b in blocks:
        by_layout.setdefault(tuple(b.tensors), []).append(b)
    mx.eval([
        mx.concatenate([b.tensors[name] for b in group], axis=2) for names, group in by_layout.items() for name in names
    ])  # fmt: skip


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """One model's prefix cache over the shared tiers (`PrefixCacheInterface`)."""

    grid = 0  # the engine's prefill grid (`PrefixCacheInterface.grid`)

    def __init__(
        self, store: CacheStore, fingerprint: str, num_layers: int, model_id: str, attention: float | None = None
    ):
        self.tiers = store
        self.fp = fingerprint
        self.B = self.block_size = store.block_size
        self.num_layers = num_layers
        self.model_id = model_id
        # restore or recompute: the prefill cost on this device and each slow tier's rate
        self.costs = RestoreModel(model_id, attention)
        self.prefill = self.costs.prefill
        self.ssd_rate = self.costs.ssd_rate
        self.warm_rate = self.costs.warm_rate
        self.warm_copy_rate = self.costs.warm_copy_rate
        # stored blocks not yet handed to the SSD writer, oldest first, and the store's
        # generation they belong to; the lock because the hot tier may let one go on another
        # model's engine thread (`_left_device`)
        self._unwritten_lock = threading.RLock()
        self._unwritten: OrderedDict[str, CacheBlock] = OrderedDict()
        self._unwritten_bytes = 0
        # unwritten blocks the hot tier let go on another model's thread, with no RAM copy:
        # this engine's next `write_back` hands them over first (their device memory is
        # outside the hot budget now, and their MLX arrays are best read on this thread)
        self._evicted: set[str] = set()
        self._owner = threading.get_ident()  # made on the engine thread (`make_prefix_cache`)
        # blocks a finished prefetch read for the next lookup, the seconds their reads took per
        # byte, and the read seconds of those `lookup` used (charged to the SSD's restore rate)
        self._staged: dict[str, HostBlock] = {}
        self._staged_s_per_byte = 0.0
        self._staged_read_s = 0.0
        # the block keys `prefetch` hashed, for the `lookup` of the same request (both are
        # asked at its admission; hashing 32,000 tokens takes 0.4 ms on this workplace's CPU)
        self._keys_ahead: tuple[list[int], int, list[str]] | None = None
        self._counted_unwritten = 0  # what `CacheCounters.unwritten_blocks` has from this model
        self._idle_probe: list[Any] | None = None  # `probe_idle`'s reads in flight (futures)
        self._idle_probe_none_at = -1  # the SSD's block count when it held none of this model's
        self.write_back_bound = WRITE_BACK_BOUND_GPU if discrete_gpu() else 0
        self._generation = store.generation
        if store.ssd is not None:
            store.follow(fingerprint, self._left_device)
        if store.demote_bound:
            store.own(fingerprint)  # `write_back` copies its evicted blocks to RAM
        # parent key ("" = root) → children stored by this process, with their tokens
        self._children: OrderedDict[str, list[tuple[str, tuple[int, ...]]]] = OrderedDict()
        self.cost_file: CostFile | None = None  # the measurements outlive the process
        if store.ssd is not None:
            device = "gpu" if mx.default_device().type == mx.gpu else "cpu"
            self.cost_file = CostFile(store.ssd.directory / "costs" / f"{fingerprint}-{device}.json")
            self.cost_file.load(self.costs)

    @property
    def bytes_per_token(self) -> int:
        return self.costs.bytes_per_token

    @bytes_per_token.setter
    def bytes_per_token(self, value: int) -> None:
        self.costs.bytes_per_token = value

    # ----- lookup / restore ----------------------------------------------------------
    def lookup(self, tokens: list[int]) -> tuple[list[Any] | None, int]:
        try:
            return self._lookup(tokens)
        finally:  # one request's read-ahead; what it did not use goes
            self._staged.clear()
            self._staged_s_per_byte = self._staged_read_s = 0.0

    def _prompt_keys(self, tokens: list[int], keep: bool = False) -> list[str]:
        """`tokens`' block keys, hashed once per admission: `prefetch` keeps them (`keep`) for
        the `lookup` that follows, which takes them. Only the same list object of the same
        length gets them: a request's prompt is never changed in place."""
        ahead, self._keys_ahead = self._keys_ahead, None
        if ahead is not None and ahead[0] is tokens and ahead[1] == len(tokens):
            return ahead[2]
        keys = block_keys(self.fp, tokens, self.B)
        if keep:
            self._keys_ahead = (tokens, len(tokens), keys)
        return keys

    def _lookup(self, tokens: list[int]) -> tuple[list[Any] | None, int]:
        limit = len(tokens) - 1  # at least one token must be computed to get logits
        keys = self._prompt_keys(tokens)
        hot, warm, ssd = self.tiers.hot, self.tiers.warm, self.tiers.ssd
        self._drop_unwritten_if_cleared()
        blocks: list[CacheBlock] = []
        for i, key in enumerate(keys):
            if (i + 1) * self.B > limit:
                break
            block = hot.get(key)  # counts the hot tier's hits and misses, as `_get` does not
            if block is None:  # the hot tier let it go: still in device memory, waiting for a copy?
                block = self._on_device(key)
                if block is None:
                    break
                hot.put(block)
            blocks.append(block)
        restored: list[tuple[Throughput, int, float]] = []  # (tier rate, bytes, seconds so far)
        skipped = False  # a slower tier held more, and recomputing it was judged faster
        if warm is not None:
            # moved when the hot tier can keep the whole run, else copied (RAM keeps it): each
            # way has its own rate (6.4 vs 1.7 GB/s on an H200)
            run = self._run_in(keys, len(blocks), limit, warm.contains)
            move = hot.can_hold(sum(held.nbytes for held in map(warm.peek, run) if held is not None))
            got, skipped = self._restore_run(
                run, len(blocks) * self.B, lambda part: (self._from_warm(key, move) for key in part),
                self.warm_rate if move else self.warm_copy_rate, restored,
            )  # fmt: skip
            blocks += got
        if ssd is not None and not skipped:
            run = self._run_in(keys, len(blocks), limit, lambda k: k in self._staged or ssd.contains(k, self.fp))
            got, skipped = self._restore_run(run, len(blocks) * self.B, self._from_ssd, self.ssd_rate, restored)
            blocks += got
        if self._staged_read_s:  # the reads ahead of what was used count into the SSD's restore time
            restored[:] = [
                (rate, nbytes, seconds + (self._staged_read_s if rate is self.ssd_rate else 0.0))
                for rate, nbytes, seconds in restored
            ]
        n = len(blocks) * self.B
        parts = [(b, self.B) for b in blocks]
        # after a skipped restore the tail, too, only comes from device memory: the token-level
        # search would otherwise fetch from the tier just judged slower than recomputing
        tail, usable = None, 0
        # no tail either when it could not reach the engine's prefill grid (a tail is shorter
        # than a block): the engine would drop it after its fetch, stalling every stream
        reach = self.grid - n % self.grid if self.grid else 1
        if limit - n >= reach and reach < self.B:  # else none is fetched, from any tier
            tail, usable = self._find_tail(keys[len(blocks) - 1] if blocks else None, tokens[n:], hot_only=skipped)
        if tail is not None:
            # an exact repeat finds the whole prompt's tail: use all but the last token
            use = min(usable, limit - n)
            if self.grid:
                use -= (n + use) % self.grid
            if use > 0 and (blocks or use >= MIN_TAIL_ONLY_TOKENS):
                parts.append((tail, use))
                n += use
        if not parts:
            return None, 0
        self._refresh_chain([block.key for block, _ in parts])
        caches = join_blocks(parts, self.num_layers)
        if restored:
            # The model's cache built from restored blocks is where their cost ends (on a CUDA
            # GPU, the first device use of host-written memory migrates it): count it into each
            # tier's restore time, shared by bytes, rather than into the prefill that follows.
            tic = time.perf_counter()
            mx.eval([c.state for c in caches])
            extra = time.perf_counter() - tic
            total = sum(nbytes for _, nbytes, _ in restored)
            for rate, nbytes, seconds in restored:
                rate.observe(nbytes, seconds + extra * nbytes / total)
            self._save_costs(force=True)
        return caches, n

    def _restore_run(
        self,
        run: list[str],
        depth: int,
        fetch: Callable[[list[str]], Iterable[CacheBlock | None]],
        rate: Throughput,
        restored: list[tuple[Throughput, int, float]],
    ) -> tuple[list[CacheBlock], bool]:
        """`run` (the keys a lower tier holds, from where device memory's end: `depth` tokens
        in), restored (and promoted to hot) when that beats recomputing them there, and whether
        some were left for recomputing instead; `fetch` yields None for a block that has gone
        meanwhile, which ends the run. What was restored and its time so far go to `restored`,
        for `lookup` to observe once the model's cache is built."""
        if not run:
            return [], False
        got: list[CacheBlock] = []
        if self.costs.due_probe(rate):
            # Never measured (or judged slower `REPROBE_AFTER` times in a row: measured once
            # under load, a tier would never be measured again), but the recompute side is
            # known: time a part of the run first, so even the first restore from a slow tier
            # is not much slower than recomputing (up to an eighth, not one block: per byte,
            # tiny restores are faster than large ones)
            probe, budget = max(1, len(run) // 8), self.costs.probe_budget(len(run) * self.B, depth)
            seconds, group, gone = 0.0, 1, False
            while len(got) < probe:
                tic = time.perf_counter()
                more, _ = self._fetch(run[len(got) : len(got) + group], fetch)
                _use_on_device(more)  # measured to the end
                seconds += time.perf_counter() - tic
                got += more
                if len(more) < group:  # a block has gone: the run ends there
                    gone = True
                    break
                group = min(2 * group, probe - len(got))
                if seconds * (len(got) + group) / len(got) > budget:  # the next group would pass it
                    break
            if got:
                rate.forget()  # stale if this probe is a re-probe
                rate.observe(sum(b.nbytes for b in got), seconds)
                self._save_costs(force=True)
            if gone:
                return got, False
            run = run[len(got) :]
        if run and not self.costs.pays(len(run) * self.B, depth + len(got) * self.B, rate):
            rate.skipped += 1
            with self.tiers.counters.lock:
                self.tiers.counters.skipped_restores += 1
            return got, True
        if run:
            more, seconds = self._fetch(run, fetch)
            if more:
                restored.append((rate, sum(b.nbytes for b in more), seconds))
            got += more
        return got, False

    def _run_in(self, keys: list[str], start: int, limit: int, contains: Callable[[str], bool]) -> list[str]:
        """The keys from `keys[start]` on that `contains` holds, as far as full blocks within
        `limit` tokens go (what a lookup would restore from that tier)."""
        run = []
        for i in range(start, len(keys)):
            if (i + 1) * self.B > limit or not contains(keys[i]):
                break
            run.append(keys[i])
        return run

    def _fetch(
        self, run: list[str], fetch: Callable[[list[str]], Iterable[CacheBlock | None]]
    ) -> tuple[list[CacheBlock], float]:
        """Restore `run` (up to the first block that has gone) and promote it to hot; the
        seconds include the promotion, which may push other blocks down a tier."""
        tic = time.perf_counter()
        got = []
        for block in fetch(run):
            if block is None:
                break
            got.append(block)
        if got:
            mx.eval([t for b in got for t in b.tensors.values()])
            self.costs.learn_size(got[0].nbytes, got[0].token_count)
            self.tiers.moved_in(sum(b.nbytes for b in got))
            for block in got:
                self.tiers.hot.put(block)
        return got, time.perf_counter() - tic

    def _from_ssd(self, run: list[str]) -> Iterable[CacheBlock | None]:
        """`run` from the SSD, in order: what a prefetch read ahead from memory, the rest (say,
        a block the hot tier let go meanwhile) from the disk."""
        i = 0
        while i < len(run):
            held = self._staged.pop(run[i], None)
            if held is not None:
                self._staged_read_s += held.nbytes * self._staged_s_per_byte
                yield held.to_block()
                i += 1
                continue
            j = i
            while j < len(run) and run[j] not in self._staged:
                j += 1
            yield from self.tiers.ssd.get_many(run[i:j], self.fp)
            i = j

    def prefetch(self, tokens: list[int], on_done: Callable[[], None]) -> Prefetch | None:
        """Make ready, off the critical path, what `lookup(tokens)` would restore from the slow
        tiers: done in `lookup`, it would stall every stream of the engine (a 32,000-token prompt
        of an 8B model is 4 GB: seconds of disk, or ~2 s of host -> device copy from RAM). The
        SSD run is read on the SSD tier's threads (`on_done` is called, on some thread, when
        the reads are over); the RAM run is moved to device memory by `advance`, a chunk per
        engine loop while other requests run. Only runs of at least `PREFETCH_MIN_BYTES` that
        the measured rates say to restore; None when there is nothing to do ahead."""
        ssd, hot, warm = self.tiers.ssd, self.tiers.hot, self.tiers.warm
        if (ssd is None and warm is None) or not self.bytes_per_token:
            return None
        limit = len(tokens) - 1
        keys = self._prompt_keys(tokens, keep=True)
        start = len(self._run_in(keys, 0, limit, self._in_device_memory))
        ram_run = self._run_in(keys, start, limit, warm.contains) if warm is not None else []
        # judged quietly: `lookup` decides again and logs what it does not find done ahead,
        # so each decision is logged once, here for the runs made ready ahead
        ram_why: tuple[Any, ...] | None = None
        if ram_run:
            pays, ram_why = self.costs.judge(len(ram_run) * self.B, start * self.B, self.warm_rate)
            if not pays:
                return None  # `lookup` recomputes from there: no SSD block is used either
        run, ssd_why = [], None
        if ssd is not None and self.ssd_rate.value is not None:
            run = self._run_in(keys, start + len(ram_run), limit, lambda k: ssd.contains(k, self.fp))
        pays = len(run) * self.B * self.bytes_per_token >= PREFETCH_MIN_BYTES
        if pays:
            pays, ssd_why = self.costs.judge(len(run) * self.B, (start + len(ram_run)) * self.B, self.ssd_rate)
        if not pays:
            run = []
        block_bytes = self.B * self.bytes_per_token
        if self.warm_rate.value is None or len(ram_run) * block_bytes < PREFETCH_MIN_BYTES:
            ram_run = []  # unmeasured: `lookup` times a part of it first; small: in line is fine
        # no more than half the hot tier: moved deepest first, a larger run would push its own
        # deep blocks out again before `lookup`, which copies the rest in line
        ram_run = ram_run[: max(0, hot.max_bytes // 2 // max(1, block_bytes))]
        if not run and not ram_run:
            return None
        futures: list[Any] = []
        if run:
            try:
                futures = ssd.read_ahead(run, self.fp)
            except Exception:  # `lookup` reads in line then
                log.exception("reading prefix-cache blocks of %s ahead failed", self.model_id)
                run = []
        if not run and not ram_run:
            return None
        log_judgement(ram_why if ram_run else None)
        log_judgement(ssd_why if run else None)
        pending = Prefetch(run, futures, ram_run)
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
        return pending

    def advance(self, prefetched: Prefetch, move: bool, alone: bool = False) -> bool:
        """Engine thread, once per loop: with `move`, put up to `RESTORE_CHUNK` bytes of the RAM
        run into device memory (the deepest blocks first, so its root ends the most recently
        used: `_refresh_chain`); with `alone` too (no other request runs, so no stream waits
        for this thread's next step) the whole run at once. True once the whole prefetch is
        ready for `take` and `lookup`. A chunk per loop made the lone request wait through each
        loop's bookkeeping as well: on an H200, 2.6 GB of an 8B prompt took 0.34 s of moves in
        0.92 s over 39 loops, and a RAM rate timed over that wall time made the rest of the
        prefix look slower to restore than to recompute."""
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
                    hot.put(block)
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
        return not prefetched.ram_keys and all(f.done() for f in prefetched.futures)

    def take(self, prefetched: Prefetch) -> None:
        """Stage a finished prefetch's blocks for the next `lookup` (up to the first that
        could not be read)."""
        self._staged.clear()
        reads = []
        for key, future in zip(prefetched.keys, prefetched.futures, strict=True):
            read = future.result() if future.done() and future.exception() is None else None
            if read is None or read.block is None:
                break
            self._staged[key] = read.block
            reads.append(read)
        self._staged_read_s = 0.0
        if reads:  # from the first read's start to the last one's end (not time queued before)
            seconds = max(r.finished for r in reads) - min(r.started for r in reads)
            self._staged_s_per_byte = seconds / max(1, sum(r.block.nbytes for r in reads))

    def _from_warm(self, key: str, move: bool) -> CacheBlock | None:
        """A block held in host RAM as MLX arrays again, or None if RAM no longer has it. With
        `move` it leaves RAM and its staged arrays are used as they are (on a CUDA GPU their
        pages migrate at first use: 4x faster than a copy); else RAM keeps it and the block is
        a copy, for a hot tier that could not keep it: it would only come back to RAM, copied
        out again. One the SSD writer has yet to read is copied too: its reads would pull the
        moved pages back to the host."""
        warm, ssd = self.tiers.warm, self.tiers.ssd
        move = move and not (ssd is not None and ssd.writing(key))
        held = warm.take(key) if move else warm.get(key)
        return held.to_block(move=move) if held is not None else None

    def _find_tail(self, parent: str | None, rest: list[int], hot_only: bool = False) -> tuple[CacheBlock | None, int]:
        """The stored block after `parent` sharing the longest token prefix with `rest`.

        Exact partial blocks are found by key (this also works after a restart); blocks
        stored by this process are also matched token by token, so a conversation whose
        template re-renders history differently (dropped reasoning, edited tail) still
        reuses everything up to the first differing token. Returns (block, usable tokens).
        """
        best: tuple[CacheBlock | None, int] = (None, 0)
        keys = tail_keys(self.fp, parent, rest[: self.B - 1])
        for length in range(len(keys), 0, -1):
            block = self._get(keys[length - 1], hot_only)
            if block is not None:
                best = (block, length)
                break
        candidates = sorted(
            ((_common_prefix(toks, rest), key) for key, toks in self._children.get(parent or "", ())),
            reverse=True,
        )
        for shared, key in candidates:
            if shared <= best[1]:
                break
            block = self._get(key, hot_only)
            if block is not None:
                return block, shared
        return best

    def _get(self, key: str, hot_only: bool = False) -> CacheBlock | None:
        """A block from device memory, else (unless `hot_only`) RAM or the SSD, promoted to
        hot; None if in none."""
        hot, warm, ssd = self.tiers.hot, self.tiers.warm, self.tiers.ssd
        if hot.contains(key):
            block = hot.get(key)
            if block is not None:
                return block
        block = self._on_device(key)  # device memory still, though the hot tier let it go
        if block is not None:
            hot.put(block)
            return block
        if hot_only:
            return None
        block = None
        if warm is not None and warm.contains(key):
            block = self._from_warm(key, move=hot.can_hold(self.B * self.bytes_per_token))
        if block is None and ssd is not None and ssd.contains(key, self.fp):
            block = ssd.get(key, self.fp)
        if block is not None:
            # evaluated here, on this engine's thread: in the hot tier another model's thread
            # may be the next to touch it (`CacheStore._left_device`)
            mx.eval(list(block.tensors.values()))
            self.tiers.moved_in(block.nbytes)
            hot.put(block)
        return block

    def _remember_child(self, parent: str | None, key: str, tokens: list[int]) -> None:
        siblings = self._children.setdefault(parent or "", [])
        self._children.move_to_end(parent or "")
        if all(k != key for k, _ in siblings):
            siblings.append((key, tuple(tokens)))
            del siblings[:-MAX_SIBLINGS]
        while len(self._children) > MAX_PARENTS:
            self._children.popitem(last=False)

    # ----- store ---------------------------------------------------------------------
    def store(self, tokens: list[int], cache: list[Any], *, final: bool, start: int = 0) -> int:
        """Store every full block not cached yet, and the unfinished tail as a partial block,
        from token `start` on.

        When only RAM keeps blocks, a finished sequence's blocks are made and copied out
        `WRITE_BACK_CHUNK` bytes (at least one block) per call, root first, and the token
        where the rest begins is returned (0: all stored): the engine calls again from there
        while idle, so a request arriving waits for one piece of the copy, not all of it."""
        n_tokens = min(len(tokens), cache[0].offset if cache else 0)
        tokens = tokens[:n_tokens]
        keys = block_keys(self.fp, tokens, self.B)
        hot, warm, ssd = self.tiers.hot, self.tiers.warm, self.tiers.ssd
        self._drop_unwritten_if_cleared()
        # A block the hot tier cannot hold would be made (a device copy per layer) only to go
        # straight back to RAM: when RAM holds it, recomputing its tokens needs no new copy.
        ram_is_enough = self._only_ram_keeps_blocks()

        def known(key: str) -> bool:
            return (
                self._in_device_memory(key)
                or (ram_is_enough and warm.contains(key))
                or (ssd is not None and ssd.contains(key, self.fp))
            )

        if start and keys and not known(keys[0]):  # cleared, or let go meanwhile: the rest would hang off nothing
            return 0
        new: list[tuple[str, str | None, int, int]] = []
        for i, key in enumerate(keys):
            if i * self.B >= start and not known(key):
                new.append((key, keys[i - 1] if i else None, i * self.B, (i + 1) * self.B))
        chain = list(keys)
        tail = len(keys) * self.B
        if tail < n_tokens:
            parent = keys[-1] if keys else None
            key = chain_key(self.fp, parent, tokens[tail:])
            chain.append(key)
            if not known(key):
                new.append((key, parent, tail, n_tokens))
        rest = 0
        if final and ram_is_enough:
            per_call = max(1, WRITE_BACK_CHUNK // max(1, self.bytes_per_token * self.B))
            if len(new) > per_call:
                rest, new = new[per_call][2], new[:per_call]
        if not new:
            self._refresh_chain(chain)
            return 0
        blocks = self._make_blocks(cache, new)
        for key, parent, a, b in new:
            self._remember_child(parent, key, tokens[a:b])
        mx.eval([t for b in blocks for t in b.tensors.values()])
        if ssd is not None:  # root first: the SSD writer takes them in this order
            with self._unwritten_lock:
                for block in blocks:
                    self._unwritten[block.key] = block
                    self._unwritten_bytes += block.nbytes
                self._count_unwritten()
        # after: one the hot tier cannot keep goes to the SSD writer at once; deepest first, so
        # a chain longer than the hot tier keeps its first blocks (`_refresh_chain`)
        self.tiers.moved_in(sum(block.nbytes for block in blocks))
        for block in reversed(blocks):
            hot.put(block)
        self._refresh_chain(chain)
        if blocks:
            self.costs.learn_size(blocks[0].nbytes, blocks[0].token_count)
        return rest

    def _refresh_chain(self, keys: list[str]) -> None:
        """Mark one chain's blocks (root first) used in every tier holding them, deepest first,
        so its root ends the most recently used. Each tier evicts its least recently used block
        first: refreshed root first, a chain would lose its first blocks first, and a chain
        without its first block serves no lookup (they all start at the root) while its other
        blocks still take room. Deepest first, eviction takes chains from their ends, as a
        prefix tree evicts leaves. The lower tiers are refreshed too: a prefix served from
        device memory for hours must not be what the SSD's budget drops first."""
        order = keys[::-1]
        for tier in (self.tiers.hot, self.tiers.warm, self.tiers.ssd):
            if tier is not None:
                tier.touch_many(order)

    def _make_blocks(self, cache: list[Any], specs: list[tuple[str, str | None, int, int]]) -> list[CacheBlock]:
        """Blocks of `cache` for `(key, parent, start, end)` token ranges. On a GPU stacked
        blocks (`KV_STACK`) are cut from one stack of each run of adjacent ranges, up to
        `STACK_GROUP_BYTES` at a time: 2 x layers + n copies for n blocks, not 2 x layers x n
        (4,000 launches for 32,000 tokens of a 1B Llama, every one a wait for the streams
        the engine decodes meanwhile), at the price of copying the bytes twice."""
        if not specs:
            return []
        if not stackable(cache):
            return [self._block(key, parent, b - a, layer_tensors(cache, a, b)) for key, parent, a, b in specs]
        per_token = 2 * len(cache) * cache[0].keys.shape[1] * cache[0].keys.shape[3] * cache[0].keys.itemsize
        most = max(1, stack_group_bytes() // max(1, per_token * self.B))
        blocks: list[CacheBlock] = []
        group: list[tuple[str, str | None, int, int]] = []
        for spec in [*specs, None]:
            if group and (spec is None or spec[2] != group[-1][3] or len(group) == most):
                lo, hi = group[0][2], group[-1][3]
                stack = mx.concatenate([t[:, :, lo:hi, :] for c in cache for t in (c.keys, c.values)])
                cut = len(group) > 1  # else the stack is the block
                blocks += [
                    self._block(key, parent, b - a, {KV_STACK: mx.contiguous(stack[:, :, a - lo : b - lo, :]) if cut else stack})
                    for key, parent, a, b in group
                ]  # fmt: skip
                group = []
            if spec is not None:
                group.append(spec)
        return blocks

    def _block(self, key: str, parent: str | None, token_count: int, tensors: dict[str, mx.array]) -> CacheBlock:
        return CacheBlock(
            key=key, parent=parent, fingerprint=self.fp, token_count=token_count,
            layer_types=["kv"] * self.num_layers, tensors=tensors,
        )  # fmt: skip

    # ----- SSD write-back ----------------------------------------------------------
    def _unwritten_block(self, key: str) -> CacheBlock | None:
        with self._unwritten_lock:
            self._drop_unwritten_if_cleared()
            return self._unwritten.get(key)

    def _in_device_memory(self, key: str) -> bool:
        """Held in the hot tier, or let go by it but still waiting for the SSD or for RAM."""
        return self.tiers.hot.contains(key) or key in self._unwritten or self.tiers.leaving(key)

    def _on_device(self, key: str) -> CacheBlock | None:
        """A block the hot tier let go that device memory still holds: one waiting for the SSD
        writer, or for its copy to RAM (taken back: no copy is needed now), or both."""
        leaving = self.tiers.reclaim(key)
        block = self._unwritten_block(key)
        return block if block is not None else leaving

    def hold_writes(self, on: bool) -> None:
        if self.tiers.ssd is not None:
            self.tiers.ssd.hold_writes(self, on)

    def write_back(self, idle: bool) -> bool:
        """Copy this model's blocks the hot tier let go to RAM (`CacheStore.demote`), then hand
        stored blocks to the SSD writer, oldest first: each up to `WRITE_BACK_CHUNK` bytes (at
        least one block), when `idle` or beyond their bounds, while the writer has room. True
        when some were moved and more wait."""
        more = self.tiers.demote_bound > 0 and self.tiers.demote(self.fp, WRITE_BACK_CHUNK, due=idle)
        ssd = self.tiers.ssd
        if not self._unwritten or ssd is None:  # the common case, after every engine step
            return more
        handed = 0
        while True:
            with self._unwritten_lock:
                self._drop_unwritten_if_cleared()  # a clear (event loop thread) may come any time
                if not self._unwritten:
                    break
                evicted = next((k for k in self._evicted if k in self._unwritten), None)
                if evicted is None:
                    self._evicted.clear()  # any left were handed over or dropped meanwhile
                    block = next(iter(self._unwritten.values()))
                else:
                    self._evicted.discard(evicted)
                    block = self._unwritten[evicted]
                if handed and handed + block.nbytes > WRITE_BACK_CHUNK:
                    break
                due = idle or evicted is not None or self._unwritten_bytes > self.write_back_bound
                if not due or not ssd.has_room():
                    if evicted is not None:
                        self._evicted.add(evicted)
                    break
                self._take_unwritten(block)
            handed += block.nbytes
            self._hand_to_ssd(self._host_copy(block))  # else copied to host memory here
        return more or (handed > 0 and bool(self._unwritten))

    def tick(self, idle: bool) -> bool:
        """Engine thread, once per loop: `write_back`; then, idle with nothing left to move,
        `probe_idle` and the save of measurements a throttled save left behind. True while
        more waits."""
        more = self.write_back(idle)
        if idle and not more:
            self.probe_idle()
            if self.cost_file is not None and self.cost_file.unsaved:
                self._save_costs(force=True)
        return more

    def probe_idle(self) -> None:
        """Engine thread, while idle: where the SSD's restore rate is unknown (the first start
        on a cache directory) or due again (`REPROBE_AFTER`), read up to `IDLE_PROBE_BYTES` of
        this model's most recently used blocks on the reader threads, make them device arrays
        here, and take that as the rate, as `lookup` would time a part of a run: no request
        pays for the timing then (at 8B on an H200 it was 0.09 s of the first one's TTFT after
        a restart). Hits and the LRU order are left as they were; the blocks are dropped.
        The prefill model is fitted to the latest prefills now too, not in the next request's
        restore decision or its prefill's observation, both on its path to a first token (on
        the H200 host, asking for a read-ahead took 2.3-2.6 ms where a RAM run was judged,
        0.3 ms otherwise; the fit takes 0.05 ms on this project's 2-core CPU, so it is not
        shown to be that difference)."""
        try:
            self.prefill.terms()
        except Exception:  # a decision that needs it logs the failure; the SSD timing goes on
            log.debug("fitting the prefill model of %s failed", self.model_id, exc_info=True)
        ssd, rate = self.tiers.ssd, self.ssd_rate
        if self._idle_probe is not None:
            if all(f.done() for f in self._idle_probe):
                self._finish_idle_probe()
            return
        if ssd is None or not rate.stale:
            return
        count = ssd.block_count
        if count == self._idle_probe_none_at:  # nothing new since it held none of ours
            return
        block_bytes = self.B * self.bytes_per_token
        keys = ssd.recent_keys(self.fp, max(1, IDLE_PROBE_BYTES // block_bytes) if block_bytes else 1)
        if not keys:
            self._idle_probe_none_at = count if ssd.wait_ready(0) else -1
            return
        self._idle_probe = ssd.read_unmarked(keys, self.fp)

    def _finish_idle_probe(self) -> None:
        reads = [f.result() for f in self._idle_probe or () if f.exception() is None]
        self._idle_probe = None
        reads = [r for r in reads if r.block is not None]
        if not reads:
            return
        tic = time.perf_counter()
        blocks = [r.block.to_block() for r in reads]
        _use_on_device(blocks)
        upload = time.perf_counter() - tic
        nbytes = sum(b.nbytes for b in blocks)
        seconds = max(r.finished for r in reads) - min(r.started for r in reads) + upload
        self.costs.learn_size(blocks[0].nbytes, blocks[0].token_count)
        self.ssd_rate.forget()  # a re-probe replaces what was measured
        self.ssd_rate.observe(nbytes, seconds)
        self._save_costs(force=True)
        log.debug("%s: SSD restores timed while idle: %d bytes in %.3fs", self.model_id, nbytes, seconds)

    def _host_copy(self, block: CacheBlock) -> CacheBlock | HostBlock:
        """The RAM tier's copy of `block` if it has one (no second device -> host copy); made
        now for one that waits for it (`CacheStore.demote`), so that one copy serves both."""
        warm = self.tiers.warm
        if warm is None:
            return block
        if self.tiers.reclaim(block.key) is not None:
            return self.tiers.to_ram(block)
        held = warm.peek(block.key)
        return held if held is not None else block

    def _left_device(self, block: CacheBlock, host: HostBlock | None) -> None:
        """The hot tier let `block` go (on some engine thread). If it still waits for the SSD
        it goes to the writer now, as `host` (the RAM tier's copy) when there is one: kept
        waiting, it would hold device memory outside the hot tier's budget, and be copied
        out a second time later. Without a RAM copy, another model's thread leaves the copy
        to this engine's next `write_back`; a writer without room makes it wait too."""
        with self._unwritten_lock:
            self._drop_unwritten_if_cleared()
            if block.key not in self._unwritten:
                return
            if host is None and threading.get_ident() != self._owner:
                self._evicted.add(block.key)  # for this engine's thread to copy out, next loop
                return
            if not self.tiers.ssd.has_room():
                return
            self._take_unwritten(block)
        self._hand_to_ssd(host if host is not None else block)

    def _take_unwritten(self, block: CacheBlock) -> None:
        # caller holds self._unwritten_lock
        del self._unwritten[block.key]
        self._unwritten_bytes -= block.nbytes
        self._count_unwritten()

    def _hand_to_ssd(self, block: CacheBlock | HostBlock) -> None:
        try:
            self.tiers.ssd.put(block)
        except Exception:  # that block is not written; caching is an optimisation
            log.exception("handing block %s to the SSD writer failed", block.key)

    def close(self, timeout: float) -> None:
        """At engine shutdown: copy to RAM this model's evicted blocks, hand the SSD writer what
        still waits (for up to `timeout` s), and stop following the store's evictions."""
        if self.tiers.demote_bound:
            self.tiers.disown(self.fp)
        self._save_costs(force=True, wait=True)  # the newest measurements, whatever was saved before
        deadline = time.monotonic() + timeout
        while self._unwritten and time.monotonic() < deadline:
            if not self.write_back(idle=True) and self._unwritten:
                time.sleep(0.01)  # the writer's queue is full: let it drain
        with self._unwritten_lock:
            if self._unwritten:
                log.warning("%d prefix-cache blocks of %s were not written to the SSD", len(self._unwritten), self.model_id)
                self._unwritten.clear()
                self._unwritten_bytes = 0
                self._count_unwritten()
            self._evicted.clear()
        self.tiers.unfollow(self.fp, self._left_device)

    def _drop_unwritten_if_cleared(self) -> None:
        """After `CacheStore.clear()` (any thread) the blocks stored before it stay unwritten."""
        with self._unwritten_lock:
            if self._generation != self.tiers.generation:
                self._generation = self.tiers.generation
                self._evicted.clear()
                self._unwritten.clear()
                self._unwritten_bytes = 0
                self._count_unwritten()

    def _count_unwritten(self) -> None:
        # caller holds self._unwritten_lock
        c = self.tiers.counters
        with c.lock:
            c.unwritten_blocks += len(self._unwritten) - self._counted_unwritten
        self._counted_unwritten = len(self._unwritten)

    # ----- bookkeeping ---------------------------------------------------------------
    def record(self, prompt_tokens: int, cached_tokens: int) -> None:
        c = self.tiers.counters
        with c.lock:
            c.requests += 1
            c.prompt_tokens += prompt_tokens
            c.hit_tokens += cached_tokens
            if cached_tokens:
                c.hits += 1
            else:
                c.misses += 1

    def hot_bytes(self) -> int:
        return self.tiers.hot.held_bytes

    def yield_memory(self, nbytes: int) -> int:
        """The hot tier's least recently used blocks leave device memory (to RAM or the SSD,
        as any eviction) until `nbytes` are freed; the bytes freed."""
        freed = self.tiers.hot.shed(nbytes)
        if freed:
            log.info("hot tier yielded %d bytes of device memory to running sequences", freed)
        return freed

    def wants_prompt_blocks(self, prompt_tokens: int, cached_tokens: int) -> bool:
        """Store right after prefill only when at least a block's worth was computed: then the
        copy is small next to the prefill; short prompts are stored when they finish. Not when
        only RAM would keep the blocks: the whole prompt's KV would be copied device -> host
        on the engine thread between the request's first and second token (on an H200, 2-3 s
        for a 32,000-token prompt of a 1B model); stored at its end, the copy delays none of
        its tokens."""
        return prompt_tokens - cached_tokens >= self.B and not self._only_ram_keeps_blocks()

    def _only_ram_keeps_blocks(self) -> bool:
        """The hot tier cannot hold one block (it is off, or smaller), so every stored block
        goes to host RAM at once, copied on the engine thread."""
        warm, hot = self.tiers.warm, self.tiers.hot
        return warm is not None and self.bytes_per_token > 0 and not hot.can_hold(self.bytes_per_token * self.B)

    def observe_prefill(self, tokens: int, depth: int, seconds: float) -> None:
        self.prefill.observe(tokens, depth, seconds)
        self._save_costs()

    def prefill_seconds(self, tokens: int, depth: int) -> float | None:
        return self.prefill.seconds(tokens, depth)

    def _save_costs(self, force: bool = False, wait: bool = False) -> None:
        """Save the measurements (`CostFile.save`) when there is an SSD to keep them beside."""
        if self.cost_file is not None:
            self.cost_file.save(self.costs, force=force, wait=wait)


def make_prefix_cache(store: CacheStore, loaded: Any) -> PrefixCacheInterface:
    """The factory the engine pool calls on the engine thread after a model loads."""
    ok, reason = sliceable(loaded.model)
    if not ok:
        log.warning("model %s is served without the prefix cache: %s", loaded.info.id, reason)
        return NoCache()
    fp = model_fingerprint(
        loaded.info.id, weights_digest(loaded.info.path), loaded.compute_dtype, "kv", store.block_size
    )
    try:
        attention = attention_ratio(loaded.model)
    except Exception:  # a prior for an estimate: never worth failing a load over
        log.warning("model %s: attention's share of the prefill cost not read from its shapes", loaded.info.id)
        attention = None
    return PrefixCache(store, fp, len(make_prompt_cache(loaded.model)), loaded.info.id, attention=attention)
