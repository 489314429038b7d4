"""One model's blocks brought from a tier into device memory (engine thread): from device memory
itself (taken back from a wait), from RAM (moved or copied), from the SSD (read ahead or in line),
and a stateful model's last state read apart (docs/design/cache-kinds.md, ram-moves.md)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

import mlx.core as mx

from omlx.cache.block import layer_states
from omlx.cache.block.block import CacheBlock, HostBlock
from omlx.cache.plan.restore_model import RestoreModel, Throughput
from omlx.cache.tiers.ssd.format import KV_PART, STATE_PART
from omlx.cache.tiers.tiers import Tiers

log = logging.getLogger("omlx.cache")

# a source of a run's blocks, in order; None: that block has gone (the run ends there)
Source = Callable[[list[str]], Iterable[CacheBlock | None]]


@dataclass
class Charge:
    """A restore's bytes and the seconds they took so far, for the rate of the tier they came from."""

    rate: Throughput
    nbytes: int
    seconds: float


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


class TierReads:
    """Reads of one model's blocks (`fingerprint`) from `tiers` into device memory, on its engine thread;
    `kv_only`: runs below device memory are read without their state; sizes learnt into `costs`."""

    def __init__(self, tiers: Tiers, fingerprint: str, block_size: int, kv_only: bool, costs: RestoreModel) -> None:
        self.tiers = tiers
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.kv_only = kv_only
        self.costs = costs

    def learn_size(self, block: CacheBlock) -> None:
        """The restore model's sizes from a whole block: KV bytes per token, and its whole state's bytes."""
        self.costs.learn_size(block.nbytes, block.token_count, layer_states.state_nbytes(block.tensors))

    def waiting_on_device(self, key: str) -> CacheBlock | None:
        """A block device memory let go but still holds (waiting for the SSD writer or its copy to RAM),
        taken back: no copy is needed now."""
        with self.tiers.lock:
            demoting = self.tiers.reclaim(key)
            block = self.tiers.directory.unwritten_block(key)
        return block if block is not None else demoting

    def from_ram(self, key: str, move: bool) -> CacheBlock | None:
        """A block from RAM as MLX arrays, or None if RAM no longer has it: with `move` it leaves RAM (its
        staged array used as it is), else a copy RAM keeps (also for one the SSD writer has yet to read)."""
        ram, ssd = self.tiers.ram, self.tiers.ssd
        if ram is None:
            return None
        move = move and not (ssd is not None and ssd.writing(key))
        held = ram.take(key) if move else ram.get(key)
        return held.to_block(move=move) if held is not None else None

    def ram_source(self, move: bool) -> Source:
        """A run from RAM (`from_ram`); a stateful model's blocks as copies of their KV tensors alone."""

        def source(keys: list[str]) -> Iterable[CacheBlock | None]:
            for key in keys:
                if not self.kv_only:
                    yield self.from_ram(key, move)
                else:
                    held = self.tiers.ram.peek(key) if self.tiers.ram is not None else None
                    yield held.part(state=False).to_block() if held is not None else None

        return source

    def ssd_source(self, ahead: dict[str, HostBlock], seconds_per_byte: float, read_s: list[float]) -> Source:
        """A run from the SSD: what was read `ahead` (its read time, `seconds_per_byte`, added to `read_s`),
        the rest from the disk (a stateful model's KV-only)."""
        ssd = self.tiers.ssd

        def source(keys: list[str]) -> Iterable[CacheBlock | None]:
            i = 0
            while i < len(keys):
                held = ahead.pop(keys[i], None)
                if held is not None:
                    read_s[0] += held.nbytes * seconds_per_byte
                    yield held.to_block()
                    i += 1
                    continue
                j = i
                while j < len(keys) and keys[j] not in ahead:
                    j += 1
                if self.kv_only:  # a stateful model's blocks KV-only: the one state used is read apart
                    yield from ssd.get_many(keys[i:j], self.fingerprint, part=KV_PART)
                else:
                    yield from ssd.get_many(keys[i:j], self.fingerprint)
                i = j

        return source

    def fetch(self, keys: list[str], source: Source, chain: frozenset[str]) -> tuple[list[CacheBlock], float]:
        """`keys` from `source` (up to the first that has gone) into device memory, pushing out none of
        `chain`; the seconds include the puts (a KV-only read kept as such, its sizes not learnt)."""
        tic = time.perf_counter()
        got = []
        for block in source(keys):
            if block is None:
                break
            got.append(block)
        if got:
            mx.eval([t for b in got for t in b.tensors.values()])
            whole = [b for b in got if not b.partial]
            if whole:
                self.learn_size(whole[0])
            self.tiers.moved_in(sum(b.nbytes for b in got))
            for block in got:
                self.tiers.device.put(block, keep=chain)
        return got, time.perf_counter() - tic

    def whole_block(self, key: str, device_only: bool, chain: frozenset[str]) -> CacheBlock | None:
        """A whole block from device memory, else (unless `device_only`) RAM or the SSD, put into device
        memory without pushing out `chain`'s blocks; None if in none (a tail's fetch)."""
        device, ram, ssd = self.tiers.device, self.tiers.ram, self.tiers.ssd
        block = device.get(key) if device.contains(key) else None
        if block is not None and not block.partial:
            return block
        block = self.waiting_on_device(key)
        if block is not None:
            device.put(block, keep=chain)
            return block
        if device_only:
            return None
        if ram is not None and ram.contains(key):
            block = self.from_ram(key, move=device.can_hold(self.costs.restore_bytes(self.block_size)))
        if block is None and ssd is not None and ssd.contains(key, self.fingerprint):
            block = ssd.get_many([key], self.fingerprint)[0]
        if block is not None:
            mx.eval(list(block.tensors.values()))  # here, on this engine's thread
            self.learn_size(block)
            self.tiers.moved_in(block.nbytes)
            device.put(block, keep=chain)
        return block

    def with_last_state(
        self, parts: list[tuple[CacheBlock, int]], charges: list[Charge], chain: frozenset[str]
    ) -> list[tuple[CacheBlock, int]]:
        """`parts` whose last block, KV-only, gets its state (read alone) and goes to device memory whole;
        where no tier has that state any more, the restore ends a block earlier."""
        while parts and parts[-1][0].partial:
            block, used = parts[-1]
            held = self.tiers.device.peek(block.key)  # kept whole by an earlier restore ending there
            if held is not None and not held.partial:
                parts[-1] = (held, used)
                continue
            tic = time.perf_counter()
            state, rate = self.state_of(block.key)
            if state is None or rate is None:
                parts.pop()
                continue
            whole = replace(block, tensors={**block.tensors, **state.tensors}, partial=False)
            mx.eval(list(state.tensors.values()))
            charges.append(Charge(rate, state.nbytes, time.perf_counter() - tic))
            log.debug("%s: the last block's state, %d bytes, from %s", self.costs.model_id, state.nbytes, self.costs.tier_name(rate))
            self.learn_size(whole)
            self.tiers.moved_in(state.nbytes)  # its KV was in device memory already
            self.tiers.device.put(whole, keep=chain)
            parts[-1] = (whole, used)
        return parts

    def state_of(self, key: str) -> tuple[CacheBlock | None, Throughput | None]:
        """A block's state tensors alone, from RAM or else the SSD, with that tier's rate; (None, None)
        where neither has the block (or its file fails its state's checksum: discarded)."""
        ram, ssd = self.tiers.ram, self.tiers.ssd
        held = ram.peek(key) if ram is not None else None
        if held is not None:
            return held.part(state=True).to_block(), self.costs.ram_copy_rate
        got = ssd.get(key, self.fingerprint, part=STATE_PART) if ssd is not None else None
        return (got, self.costs.ssd_rate) if got is not None else (None, None)
