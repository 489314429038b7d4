"""The SSD's restore rate timed while its engine is idle, on its model's most recent blocks, so that
no request pays for the timing; the prefill fit made then too (docs/design/restore-or-recompute.md)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from omlx.cache.loader.tier_reads import TierReads, use_on_device
from omlx.cache.plan.restore_model import RestoreModel
from omlx.cache.tiers.tiers import Tiers

log = logging.getLogger("omlx.cache")

# An idle engine times its SSD's restores on this much of its blocks (at least one): a request
# arriving meanwhile may wait behind these reads on the reader threads.
IDLE_PROBE_BYTES = 32 << 20


class IdleProbe:
    """One model's idle timing of the SSD (engine thread): reads on the reader threads (`in_flight`),
    finished by a later call; nothing counted as a hit, nothing moved in the LRU order."""

    def __init__(
        self, tiers: Tiers, fingerprint: str, block_size: int, costs: RestoreModel, reads: TierReads,
        save_costs: Callable[[bool], None],
    ) -> None:  # fmt: skip
        self.tiers = tiers
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.costs = costs
        self.reads = reads
        self.save_costs = save_costs
        self.in_flight: list[Future[Any]] | None = None
        self.none_at = -1  # the SSD's block count when it held none of this model's blocks

    def step(self) -> None:
        """Fit the prefill model; where the SSD's rate is unknown or due again, start timing reads of this
        model's most recent blocks (up to `IDLE_PROBE_BYTES`), or finish the ones started before."""
        try:
            self.costs.prefill.terms()
        except (ArithmeticError, ValueError):  # a decision that needs it logs the failure; the SSD timing goes on
            log.debug("fitting the prefill model of %s failed", self.costs.model_id, exc_info=True)
        ssd = self.tiers.ssd
        if self.in_flight is not None:
            if all(f.done() for f in self.in_flight):
                self._finish()
            return
        if ssd is None or not self.costs.ssd_rate.stale:
            return
        count = ssd.block_count
        if count == self.none_at:  # nothing new since it held none of ours
            return
        block_bytes = self.costs.restore_bytes(self.block_size)
        keys = ssd.recent_keys(self.fingerprint, max(1, IDLE_PROBE_BYTES // block_bytes) if block_bytes else 1)
        if not keys:
            self.none_at = count if ssd.wait_ready(0) else -1
            return
        self.in_flight = ssd.read_unmarked(keys, self.fingerprint)

    def _finish(self) -> None:
        reads = [f.result() for f in self.in_flight or () if f.exception() is None]
        self.in_flight = None
        reads = [r for r in reads if r.block is not None]
        if not reads:
            return
        tic = time.perf_counter()
        blocks = [r.block.to_block() for r in reads]
        use_on_device(blocks)
        upload = time.perf_counter() - tic
        nbytes = sum(b.nbytes for b in blocks)
        seconds = max(r.finished for r in reads) - min(r.started for r in reads) + upload
        self.reads.learn_size(blocks[0])
        self.costs.ssd_rate.forget()  # a re-probe replaces what was measured
        self.costs.ssd_rate.observe(nbytes, seconds)
        self.save_costs(True)
        log.debug("%s: SSD restores timed while idle: %d bytes in %.3fs", self.costs.model_id, nbytes, seconds)
