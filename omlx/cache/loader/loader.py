"""The loader: carries out a `RestorePlan` on its model's engine thread. `load` starts the work ahead
(SSD reads on reader threads, judged again by a `ReadWatch`), `advance` moves a RAM run a bounded piece
per loop, `cache_for` restores the rest in line and returns the model's cache (docs/design/ram-moves.md)."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from omlx.cache.block import layer_states
from omlx.cache.block.block import CacheBlock, HostBlock
from omlx.cache.block.kinds import CacheKinds
from omlx.cache.block.kv_layout import join_blocks
from omlx.cache.loader.loading import Loading, when_all_done
from omlx.cache.loader.tier_reads import Charge, Source, TierReads, use_on_device
from omlx.cache.plan import decide
from omlx.cache.plan.read_watch import ReadWatch, finished_read
from omlx.cache.plan.restore_model import RestoreModel, Throughput
from omlx.cache.plan.restore_plan import RestorePlan, Run, Tier
from omlx.cache.tiers.ssd.format import ALL, KV_PART
from omlx.cache.tiers.tiers import Tiers

log = logging.getLogger("omlx.cache")

# A RAM run made ready ahead moves this much into device memory per engine loop while other requests
# run or wait (all of it at once otherwise): docs/design/ram-moves.md.
MOVE_CHUNK = 64 << 20


class Loader:
    """One model's restores (`fingerprint`, `block_size`, `num_layers`, its layer `kinds` or None for plain
    KV) from `tiers`, timed into `costs`; `save_costs(force)` keeps the measurements, `after_puts()` hands
    on what device memory let go meanwhile (the saver's write-back). Engine thread only."""

    def __init__(
        self,
        tiers: Tiers,
        fingerprint: str,
        block_size: int,
        num_layers: int,
        kinds: CacheKinds | None,
        costs: RestoreModel,
        *,
        save_costs: Callable[[bool], None],
        after_puts: Callable[[], None],
    ) -> None:
        self.tiers = tiers
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.num_layers = num_layers
        self.kinds = kinds
        self.kv_only = kinds is not None and kinds.stateful
        self.costs = costs
        self.save_costs = save_costs
        self.after_puts = after_puts
        self.reads = TierReads(tiers, fingerprint, block_size, self.kv_only, costs)

    # ----- ahead of the insert -----------------------------------------------------------
    def load(self, plan: RestorePlan, on_ready: Callable[[], None] = lambda: None) -> Loading:
        """Start what `plan` makes ready ahead: its SSD run read on the reader threads (`on_ready`, any
        thread, once they are over or cut), its RAM run left to `advance`. Never waits for I/O."""
        loading = Loading(plan)
        ram, ssd = plan.run_in(Tier.RAM), plan.run_in(Tier.SSD)
        if ram is not None and ram.ahead:
            loading.to_move = list(ram.keys[: ram.ahead])
        if ssd is not None and ssd.ahead and self.tiers.ssd is not None:
            try:
                loading.reads = self.tiers.ssd.read_ahead(list(ssd.keys), self.fingerprint, part=KV_PART if self.kv_only else ALL)
            except RuntimeError:  # its reader threads were stopped: `cache_for` reads in line then
                log.exception("reading prefix-cache blocks of %s ahead failed", self.costs.model_id)
            if loading.reads:
                when_all_done(loading.reads, on_ready)
                loading.watch = self._watch(loading.reads, ssd, plan, on_ready)
        return loading

    def _watch(self, reads: list[Any], run: Run, plan: RestorePlan, on_cut: Callable[[], None]) -> ReadWatch | None:
        """A `ReadWatch` judging the reads of `run` again by the plan's own estimate (None where the plan
        cannot tell what recomputing costs): a read-ahead judged on a wrong rate is cut short, and
        `on_cut` says so at once (the reads under way then finish unwaited for)."""
        size, depth = self.block_size, run.first * self.block_size
        rest = [plan.recompute_seconds((len(reads) - k) * size, depth + k * size) for k in range(len(reads) + 1)]
        if any(s is None for s in rest):
            return None
        block_bytes = self.costs.bytes_per_token * size if self.kv_only else self.costs.restore_bytes(size)
        watch = ReadWatch(
            reads, block_bytes, rest, workers=self.tiers.ssd.read_workers, expected_rate=run.verdict.rate,
            upload_rate=self.costs.ram_move_rate.value, on_cut=on_cut,
        )  # fmt: skip
        watch.begin()
        return watch

    def advance(self, loading: Loading, move: bool, alone: bool = False) -> bool:
        """Engine thread, once per loop: with `move`, up to `MOVE_CHUNK` of the RAM run into device memory,
        deepest first (all of it when `alone`: nothing else runs or waits); True once all is ready."""
        if move and loading.to_move:
            self._move_piece(loading, alone)
        ready_reads = loading.cut or all(f.done() for f in loading.reads)
        return not loading.to_move and ready_reads

    def _move_piece(self, loading: Loading, alone: bool) -> None:
        tic = time.perf_counter()
        moved: list[CacheBlock] = []
        size = 0
        while loading.to_move and (alone or size < MOVE_CHUNK):
            key = loading.to_move[-1]
            block = self._on_device(key) or self.reads.from_ram(key, move=True)  # the run fits in half the hot tier
            if block is None:  # RAM let it go: `cache_for` restores what is left, or recomputes
                loading.to_move.clear()
                break
            loading.to_move.pop()
            loading.moved[key] = block
            if not self.tiers.device.contains(key):
                moved.append(block)
                size += block.nbytes
        if not moved:
            return
        # a device operation over every array: on CUDA their first device use migrates them
        mx.eval([t.sum() for b in moved for t in b.tensors.values()])
        self.tiers.moved_in(size)
        for block in moved:
            self.tiers.device.put(block, keep=frozenset(loading.plan.keys))
        toc = time.perf_counter()
        self.costs.ram_move_rate.observe(size, toc - tic)
        self.save_costs(False)
        loading.first_move = tic if loading.first_move is None else loading.first_move
        loading.moving_s += toc - tic
        loading.loops += 1
        if not loading.to_move:
            log.debug(
                "%s: %d blocks moved in from RAM ahead in %d loops: %.3fs moving, %.3fs from the first move",
                self.costs.model_id, len(loading.moved), loading.loops, loading.moving_s, toc - loading.first_move,
            )  # fmt: skip

    def _on_device(self, key: str) -> CacheBlock | None:
        """`key` already in device memory (another request moved it in, or it waits there to leave)."""
        block = self.tiers.device.peek(key)
        return block if block is not None else self.reads.waiting_on_device(key)

    # ----- the insert ----------------------------------------------------------------------
    def cache_for(self, loading: Loading) -> tuple[list[Any] | None, int]:
        """The model's cache for `loading`'s plan (None, 0 when nothing is restored) and its length: what
        was made ready ahead, the rest restored in line, each run as the plan judged it."""
        plan = loading.plan
        ahead, seconds_per_byte = self._take_reads(loading)
        chain = frozenset(plan.keys)
        charges: list[Charge] = []
        blocks: list[CacheBlock] = []
        held = 0  # bytes of a stateful chain's KV in device memory (`_charge`)
        complete = True
        tiers = {tail.key: tail.tier for tail in plan.tails}  # each block's tier as planned, for the report
        for run in plan.runs:
            got, whole = self._carry_out(run, loading, ahead, seconds_per_byte, charges, chain)
            tiers.update((block.key, run.tier) for block in got)
            if run.tier is Tier.DEVICE and self.kv_only:
                held = sum(b.nbytes for b in got)
            blocks += got
            if not whole or len(got) < run.blocks:
                complete = False
                break
        parts = [(block, self.block_size) for block in blocks]
        if complete:
            parts += self._tail(plan, chain)
        if self.kv_only:  # a run read KV-only: its last block's state, alone
            before = len(parts)
            parts = self.reads.with_last_state(parts, charges, chain)
            loading.lost_state = len(parts) < before
        loading.parts = [(tiers.get(block.key, Tier.DEVICE), used, block.nbytes) for block, used in parts]
        self.after_puts()
        if not parts:
            return None, 0
        self.tiers.touch_chain([block.key for block, _ in parts])
        caches = join_blocks(parts, self.num_layers) if self.kinds is None else layer_states.restore(self.kinds, parts)
        if charges:
            loading.seconds = self._charge(caches, charges, held)
        return caches, sum(used for _, used in parts)

    def _take_reads(self, loading: Loading) -> tuple[dict[str, HostBlock], float]:
        """The blocks read ahead (from the root up to the first not read) and their read seconds per
        byte; a read-ahead cut short sets the SSD's rate to what its reads showed."""
        watch = loading.watch
        if watch is not None:
            watch.close()
            if watch.cut:
                self.costs.ssd_rate.forget()  # measured at this run's size just now: what it was before is wrong
                self.costs.ssd_rate.observe(max(watch.read_bytes, watch.block_bytes), watch.cut_after)
                self.save_costs(True)
                log.info(
                    "%s: the SSD read-ahead was cut short after %.3fs (%d bytes read): slower than recomputing",
                    self.costs.model_id, watch.cut_after, watch.read_bytes,
                )  # fmt: skip
        reads = []
        for future in loading.reads:
            read = finished_read(future)
            if read is None:
                break
            reads.append(read)
        if not reads:
            return {}, 0.0
        seconds = max(r.finished for r in reads) - min(r.started for r in reads)  # not the time queued before
        return {r.block.key: r.block for r in reads}, seconds / max(1, sum(r.block.nbytes for r in reads))

    def _carry_out(
        self, run: Run, loading: Loading, ahead: dict[str, HostBlock], seconds_per_byte: float,
        charges: list[Charge], chain: frozenset[str],
    ) -> tuple[list[CacheBlock], bool]:  # fmt: skip
        """One run of the plan as it was judged, and whether all of it was restored: device memory's taken
        back, a run that does not pay counted and left, a cut read-ahead's blocks read, a stale tier probed."""
        if run.tier is Tier.DEVICE:
            return self._device_run(run.keys, chain), True
        rate = self._judged_rate(run)
        self.costs.log_verdict(run.blocks * self.block_size, run.first * self.block_size, rate, run.verdict)
        if not run.verdict.restore:
            self._skipped(rate)
            return [], False
        read_s = [0.0]
        source = self.reads.ssd_source(ahead, seconds_per_byte, read_s) if run.tier is Tier.SSD else self.reads.ram_source(run.move)
        if run.tier is Tier.SSD and loading.cut:  # what was read, where moving it in pays, then recompute
            read = self._worth_moving(list(itertools.takewhile(lambda k: k in ahead, run.keys)), run, loading.plan, ahead)
            got, seconds = self.reads.fetch(read, source, chain)
            if got:
                charges.append(Charge(rate, sum(b.nbytes for b in got), seconds + read_s[0]))
            return got, False
        got = self._moved_ahead(run, loading)
        if run.probe:
            more, whole = self._probe(run, len(got), source, rate, charges, chain, loading)
            return got + more, whole
        more, seconds = self.reads.fetch(list(run.keys[len(got) :]), source, chain)
        if more:
            charges.append(Charge(self._charged_rate(run), sum(b.nbytes for b in more), seconds + read_s[0]))
        return got + more, True

    def _worth_moving(self, keys: list[str], run: Run, plan: RestorePlan, ahead: dict[str, HostBlock]) -> list[str]:
        """`keys`, the first blocks of `run` a cut read-ahead read, where moving them into device memory
        pays against recomputing them (`decide.takes_what_was_read`), else none."""
        if not keys:
            return keys
        recompute = plan.recompute_seconds(len(keys) * self.block_size, run.first * self.block_size)
        nbytes = sum(ahead[key].nbytes for key in keys)
        return keys if decide.takes_what_was_read(nbytes, self.costs.ram_move_rate.value, recompute) else []

    def _moved_ahead(self, run: Run, loading: Loading) -> list[CacheBlock]:
        """A RAM run's first blocks that `advance` moved (or found) in device memory, up to the first not."""
        got = []
        for key in run.keys[: run.ahead] if run.tier is Tier.RAM else ():
            block = loading.moved.get(key) or self._on_device(key)
            if block is None:
                break
            got.append(block)
        return got

    def _device_run(self, keys: tuple[str, ...], chain: frozenset[str]) -> list[CacheBlock]:
        """The blocks device memory held from the root when the plan was made (one taken back from a wait
        pushes out none of `chain`); one that left it since is read from where it is now, whole."""
        blocks: list[CacheBlock] = []
        for key in keys:
            block = self.tiers.device.get(key)  # counts the hot tier's hits and misses
            if block is None:
                block = self.reads.whole_block(key, False, chain)
                if block is None:
                    break
            blocks.append(block)
        return blocks

    def _probe(
        self, run: Run, start: int, source: Source, rate: Throughput, charges: list[Charge], chain: frozenset[str],
        loading: Loading,
    ) -> tuple[list[CacheBlock], bool]:  # fmt: skip
        """A stale tier timed on a part of `run` (from block `start`) first: up to an eighth, in groups of
        1, 2, 4 ... blocks within `PROBE_SHARE` of recomputing the run; the rest judged again on what it
        showed (`decide.verdict`). The blocks got, and whether the rest was restored too."""
        size, depth, keys = self.block_size, run.first * self.block_size, list(run.keys[start:])
        most, budget = decide.probe_blocks(len(keys)), decide.probe_budget(len(keys) * size, depth, self.costs.costs())
        got: list[CacheBlock] = []
        seconds, group, gone = 0.0, 1, False
        while len(got) < most:
            tic = time.perf_counter()
            more, _ = self.reads.fetch(keys[len(got) : len(got) + group], source, chain)
            use_on_device(more)  # measured to the end
            seconds += time.perf_counter() - tic
            got += more
            if len(more) < group:  # a block has gone: the run ends there
                gone = True
                break
            group = min(2 * group, most - len(got))
            if not decide.next_probe_group(seconds, len(got), group, budget):
                break
        if got:
            rate.forget()  # stale if this probe is a re-probe
            rate.observe(sum(b.nbytes for b in got), seconds)
            self.save_costs(True)
        rest = keys[len(got) :]
        if gone or not rest:
            return got, not gone
        at = depth + (start + len(got)) * size
        verdict = decide.verdict(len(rest) * size, at, rate.snapshot(), self.costs.costs())
        self.costs.log_verdict(len(rest) * size, at, rate, verdict)
        if not verdict.restore:
            self._skipped(rate)
            loading.probed_slower = True
            return got, False
        more, seconds = self.reads.fetch(rest, source, chain)
        if more:
            charges.append(Charge(rate, sum(b.nbytes for b in more), seconds))
        return got + more, True

    def _judged_rate(self, run: Run) -> Throughput:
        """The rate `run` was judged on: the SSD's, RAM moves' (moved ahead or moved), else RAM copies'."""
        if run.tier is Tier.SSD:
            return self.costs.ssd_rate
        return self.costs.ram_move_rate if run.ahead or run.move else self.costs.ram_copy_rate

    def _charged_rate(self, run: Run) -> Throughput:
        """The rate a restore in line of `run` is charged to (a RAM run's rest moved or copied)."""
        if run.tier is Tier.SSD:
            return self.costs.ssd_rate
        return self.costs.ram_move_rate if run.move else self.costs.ram_copy_rate

    def _skipped(self, rate: Throughput) -> None:
        rate.skipped += 1
        self.tiers.counters.skipped()

    def _tail(self, plan: RestorePlan, chain: frozenset[str]) -> list[tuple[CacheBlock, int]]:
        """The first of the plan's tails still found (device memory's only where it was judged so)."""
        for tail in plan.tails:
            block = self.reads.whole_block(tail.key, tail.tier is Tier.DEVICE, chain)
            if block is not None:
                return [(block, tail.tokens)]
        return []

    def _charge(self, caches: list[Any], charges: list[Charge], held: int) -> dict[Tier, float]:
        """The model's cache built from restored blocks is where their cost ends (on a CUDA GPU the first
        device use of host-written memory migrates it): that time goes into each tier's restore time,
        shared by bytes; `held` bytes from device memory take their share unbilled. The seconds per tier."""
        tic = time.perf_counter()
        mx.eval([c.state for c in caches])
        extra = time.perf_counter() - tic
        total = max(1, held + sum(c.nbytes for c in charges))  # a KV-only run of recurrent layers alone reads none
        spent: dict[Tier, float] = {}
        for c in charges:
            seconds = c.seconds + extra * c.nbytes / total
            c.rate.observe(c.nbytes, seconds)
            tier = Tier.SSD if c.rate is self.costs.ssd_rate else Tier.RAM
            spent[tier] = spent.get(tier, 0.0) + seconds
        self.save_costs(True)
        return spent
