"""Write-back: one model's stored blocks wait in device memory and are handed to the SSD writer later,
a bounded piece per engine loop (its RAM copies first, demoted on this thread), so no step waits for a
whole prompt's device -> host copy. Why and the figures: docs/design/write-back.md."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from omlx.cache.block.block import CacheBlock, HostBlock
from omlx.cache.tiers.tiers import Tiers

log = logging.getLogger("omlx.cache")

# At most this many bytes (one block at least) are copied out of device memory per engine loop, so a
# step, or a request arriving at an idle engine, waits for at most that much copying.
WRITE_BACK_CHUNK = 16 << 20
# While requests run on a CUDA GPU, the engine thread's device -> host copies (RAM copies of
# blocks let go, hand-offs to the SSD writer) take at most this share of its time: each one
# holds up every stream (docs/design/write-back.md, "Copies while requests run").
BUSY_COPY_SHARE = 0.1
BUSY_COPY_BURST_S = 0.02  # the most time saved up for them: about one 8B block's copy


class CopyPacer:
    """Time a busy engine may spend on copies: each call of `ready` earns `share` of the
    time since the last one (up to `burst`), each copy spends its seconds (`spend`)."""

    def __init__(
        self, share: float = BUSY_COPY_SHARE, burst: float = BUSY_COPY_BURST_S, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.share, self.burst, self.clock = share, burst, clock
        self.balance = 0.0
        self._last: float | None = None

    def ready(self) -> bool:
        now = self.clock()
        if self._last is not None:
            self.balance = min(self.burst, self.balance + self.share * (now - self._last))
        self._last = now
        return self.balance >= 0

    def spend(self, seconds: float) -> None:
        self.balance -= seconds

    def rest(self) -> None:
        """Idle: what is copied now is not paced, and the idle time earns nothing."""
        self._last = None


class WriteBack:
    """One model's (`fingerprint`) blocks between device memory and the SSD writer: stored blocks wait
    (`UNWRITTEN`), `write_back` hands them over on the engine thread; a block device memory lets go on any
    thread (`left_device`) goes over as its RAM copy, or waits, marked EVICTED, for this model's engine."""

    def __init__(self, tiers: Tiers, fingerprint: str, pacer: CopyPacer | None = None) -> None:
        self.tiers = tiers
        self.fingerprint = fingerprint
        self.pacer = pacer if pacer is not None else CopyPacer()

    def await_write(self, blocks: list[CacheBlock], generation: int) -> None:
        """Just stored `blocks` wait for `write_back`, root first (the writer's order), unless the tiers
        were cleared since `generation` (what was stored before a clear is not written)."""
        directory = self.tiers.directory
        with directory.lock:
            if generation != directory.generation:
                return
            for block in blocks:
                directory.await_write(block)

    def step(self, idle: bool) -> bool:
        """Engine thread: copy this model's let-go blocks to RAM (`Tiers.demote`), then hand stored blocks to
        the SSD writer, up to `WRITE_BACK_CHUNK`; True when some moved and more wait. Busy, only blocks
        device memory let go move, within `CopyPacer`'s share (docs/design/write-back.md)."""
        if idle:
            self.pacer.rest()
            return self._write_back(idle)
        if not self.pacer.ready():
            return False
        tic = self.pacer.clock()
        try:
            return self._write_back(idle)
        finally:
            self.pacer.spend(self.pacer.clock() - tic)

    def _write_back(self, idle: bool) -> bool:
        more = self.tiers.demote_bound > 0 and self.tiers.demote(self.fingerprint, WRITE_BACK_CHUNK, due=idle)[0]
        ssd, directory = self.tiers.ssd, self.tiers.directory
        if ssd is None or not directory.unwritten(self.fingerprint):  # the common case, after every engine step
            return more
        handed = 0
        while True:
            with directory.lock:
                block, evicted = directory.next_unwritten(self.fingerprint)
                if block is None or (handed and handed + block.nbytes > WRITE_BACK_CHUNK):
                    break
                if not (idle or evicted) or not ssd.has_room():
                    break
                directory.take_unwritten(block)
            handed += block.nbytes
            self._hand_to_ssd(self._host_copy(block))  # else copied to host memory here
        return more or (handed > 0 and directory.unwritten(self.fingerprint) > 0)

    def hand_over_evicted(self) -> None:
        """Engine thread, after it put blocks into device memory: this model's unwritten blocks let go meanwhile
        (EVICTED) go to the SSD writer now, copied here where RAM has no copy (none stays outside the budget)."""
        ssd, directory = self.tiers.ssd, self.tiers.directory
        if ssd is None:
            return
        while True:
            with directory.lock:
                block, evicted = directory.next_unwritten(self.fingerprint)
                if block is None or not evicted or not ssd.has_room():
                    return
                directory.take_unwritten(block)
            self._hand_to_ssd(self._host_copy(block))

    def left_device(self, block: CacheBlock, host: HostBlock | None) -> None:
        """Device memory let `block` go (any thread; no MLX here): if it waits for the SSD it goes to the writer
        now as `host`, its RAM copy; without one, or with the writer full, it is marked EVICTED, handed over
        first by this model's engine (`hand_over_evicted`, `step`)."""
        directory = self.tiers.directory
        with directory.lock:
            if directory.unwritten_block(block.key) is None:
                return
            if host is None or not self.tiers.ssd.has_room():
                directory.mark_evicted(block.key)
                return
            directory.take_unwritten(block)
        self._hand_to_ssd(host)

    def _host_copy(self, block: CacheBlock) -> CacheBlock | HostBlock:
        """The RAM tier's copy of `block` if it has one (no second device -> host copy); made now for one
        that waits for it (demotion), so that one copy serves both."""
        ram, demotion = self.tiers.ram, self.tiers.demotion
        if ram is None or demotion is None:
            return block
        if self.tiers.reclaim(block.key) is not None:
            return demotion.to_ram(block)
        held = ram.peek(block.key)
        return held if held is not None else block

    def _hand_to_ssd(self, block: CacheBlock | HostBlock) -> None:
        tic = time.perf_counter()
        try:
            self.tiers.ssd.put(block)
            if isinstance(block, CacheBlock):  # the writer's host view of it was made here
                self.tiers.copies.add("handed", block.nbytes, tic)
        except (RuntimeError, ValueError, OSError):  # that block is not written; caching is an optimisation
            log.exception("handing block %s to the SSD writer failed", block.key)

    def unwritten_bytes(self) -> int:
        """Bytes of this model's blocks waiting for the SSD writer."""
        return self.tiers.directory.unwritten_bytes(self.fingerprint)

    def drain(self, timeout: float) -> int:
        """At its engine's close: hand over what still waits, for up to `timeout` seconds; how many were dropped."""
        deadline = time.monotonic() + timeout
        directory = self.tiers.directory
        while directory.unwritten(self.fingerprint) and time.monotonic() < deadline:
            if not self.step(idle=True) and directory.unwritten(self.fingerprint):
                time.sleep(0.01)  # the writer's queue is full: let it drain
        return directory.drop_unwritten(self.fingerprint)
