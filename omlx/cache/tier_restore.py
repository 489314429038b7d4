"""Restoring a run of blocks from a slower tier (RAM or SSD) into the hot tier, timed for the
restore model; a tier never measured is probed on a part of the run first; a stateful model's
run is read KV-only but its last block (docs/design/cache-kinds.md). Mixed into `PrefixCache`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

import mlx.core as mx

from omlx.cache.block import CacheBlock
from omlx.cache.restore_model import Throughput
from omlx.cache.ssd_format import KV_PART, STATE_PART

log = logging.getLogger("omlx.cache")


def use_on_device(blocks: list[CacheBlock]) -> None:
    """A device operation over every tensor of `blocks`: on a CUDA GPU an array made from host
    bytes reaches device memory only at its first use, part of what a restore costs."""
    by_layout: dict[tuple[str, ...], list[CacheBlock]] = {}  # a chain may mix the two formats
    for b in blocks:
        by_layout.setdefault(tuple(b.tensors), []).append(b)
    mx.eval([
        mx.concatenate([b.tensors[name] for b in group], axis=2) if group[0].tensors[name].ndim > 2
        else group[0].tensors[name] + 0  # a state array of fewer axes: used on its own
        for names, group in by_layout.items() for name in names
    ])  # fmt: skip


class TierRestore:
    """The restore path of `PrefixCache.lookup` below device memory."""

    def _restore_run(
        self,
        run: list[str],
        depth: int,
        fetch: Callable[[list[str]], Iterable[CacheBlock | None]],
        rate: Throughput,
        restored: list[tuple[Throughput, int, float]],
        chain: frozenset[str] = frozenset(),
    ) -> tuple[list[CacheBlock], bool]:
        """Restore `run` (keys a lower tier holds, `depth` tokens in) into the hot tier when that
        beats recomputing it there; (blocks got, whether some were left to recompute). Restores and
        their time so far go to `restored`; a block gone meanwhile (`fetch` gives None) ends the run."""
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
                more, _ = self._fetch(run[len(got) : len(got) + group], fetch, chain)
                use_on_device(more)  # measured to the end
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
            more, seconds = self._fetch(run, fetch, chain)
            if more:
                restored.append((rate, sum(b.nbytes for b in more), seconds))
            got += more
        return got, False

    def _fetch(
        self,
        run: list[str],
        fetch: Callable[[list[str]], Iterable[CacheBlock | None]],
        chain: frozenset[str] = frozenset(),
    ) -> tuple[list[CacheBlock], float]:
        """Restore `run` (up to the first block that has gone) and promote it to hot (a `partial` read as
        KV-only); the seconds include the promotion, which may push other blocks (none of `chain`) down."""
        tic = time.perf_counter()
        got = []
        for block in fetch(run):
            if block is None:
                break
            got.append(block)
        if got:
            mx.eval([t for b in got for t in b.tensors.values()])
            whole = [b for b in got if not b.partial]  # a KV-only read: kept hot as such, sizes not learnt from it
            if whole:
                self._learn_size(whole[0])
            self.tiers.moved_in(sum(b.nbytes for b in got))
            for block in got:
                self.tiers.hot.put(block, keep=chain)
        return got, time.perf_counter() - tic

    def _from_ssd(self, run: list[str]) -> Iterable[CacheBlock | None]:
        """`run` from the SSD, in order: what a prefetch read ahead from memory, the rest (say,
        a block the hot tier let go meanwhile) from the disk."""
        i = 0
        while i < len(run):
            held = self.tiers.directory.unstage(run[i])
            if held is not None:
                self._staged_read_s += held.nbytes * self._staged_s_per_byte
                yield held.to_block()
                i += 1
                continue
            j = i
            while j < len(run) and not self.tiers.directory.is_staged(run[j]):
                j += 1
            if not self.by_part:
                yield from self.tiers.ssd.get_many(run[i:j], self.fp)
            else:  # a stateful model's blocks KV-only: `_with_last_state` reads the one state used
                yield from self.tiers.ssd.get_many(run[i:j], self.fp, part=KV_PART)
            i = j

    def _from_warm(self, key: str, move: bool) -> CacheBlock | None:
        """A block from host RAM as MLX arrays, or None if RAM no longer has it: with `move` it
        leaves RAM (its staged array used as it is), else a copy that RAM keeps (also for one the SSD
        writer has yet to read). Why: docs/design/ram-moves.md."""
        warm, ssd = self.tiers.warm, self.tiers.ssd
        move = move and not (ssd is not None and ssd.writing(key))
        held = warm.take(key) if move else warm.get(key)
        return held.to_block(move=move) if held is not None else None

    def _from_warm_run(self, run: list[str], move: bool) -> Iterable[CacheBlock | None]:
        """`run` from host RAM (`_from_warm`); a stateful model's blocks as copies of their KV
        tensors alone (RAM keeps them whole: the state arrays never reach the device)."""
        for key in run:
            if not self.by_part:
                yield self._from_warm(key, move)
            else:
                held = self.tiers.warm.get(key)
                yield held.part(state=False).to_block() if held is not None else None

    def _with_last_state(
        self, parts: list[tuple[CacheBlock, int]], restored: list[tuple[Throughput, int, float]], chain: frozenset[str]
    ) -> list[tuple[CacheBlock, int]]:
        """`parts` whose last block, KV-only (read so, or so in the hot tier), gets its state (read alone)
        and goes to the hot tier whole; where no tier has that state any more, the restore ends a block earlier."""
        while parts and parts[-1][0].partial:
            block, used = parts[-1]
            held = self.tiers.hot.peek(block.key)  # kept whole by an earlier restore ending there (not a lookup's hit or miss)
            if held is not None and not held.partial:
                parts[-1] = (held, used)
                continue
            tic = time.perf_counter()
            state, rate = self._state_of(block.key)
            if state is None:
                parts.pop()
                continue
            whole = replace(block, tensors={**block.tensors, **state.tensors}, partial=False)
            mx.eval(list(state.tensors.values()))
            restored.append((rate, state.nbytes, time.perf_counter() - tic))
            log.debug("%s: the last block's state, %d bytes, from %s", self.model_id, state.nbytes, self.costs.tier_name(rate))
            self._learn_size(whole)
            self.tiers.moved_in(state.nbytes)  # its KV was in the hot tier already
            self.tiers.hot.put(whole, keep=chain)
            parts[-1] = (whole, used)
        return parts

    def _state_of(self, key: str) -> tuple[CacheBlock | None, Throughput | None]:
        """A block's state tensors alone, from RAM or else the SSD, with that tier's rate; (None, None)
        where neither has the block (or its file fails its state's checksum: discarded)."""
        warm, ssd = self.tiers.warm, self.tiers.ssd
        held = warm.peek(key) if warm is not None else None
        if held is not None:
            return held.part(state=True).to_block(), self.warm_copy_rate
        got = ssd.get(key, self.fp, part=STATE_PART) if ssd is not None else None
        return (got, self.ssd_rate) if got is not None else (None, None)
