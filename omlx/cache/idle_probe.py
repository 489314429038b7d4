"""The cache's background work while its engine is idle (`tick`): write-back first, then the
SSD's restore rate timed where no request would have to pay for it. Mixed into
`PrefixCache`."""

from __future__ import annotations

import logging
import time

from omlx.cache.tier_restore import use_on_device

log = logging.getLogger("omlx.cache")

# An idle engine times its SSD's restores (`PrefixCache.probe_idle`) on this much of its blocks
# (at least one): a request arriving meanwhile may wait behind these reads on the reader threads.
IDLE_PROBE_BYTES = 32 << 20


class IdleProbe:
    """`tick` and `probe_idle` of `PrefixCache`."""

    def tick(self, idle: bool, *, quiet: bool = True) -> bool:
        """Engine thread, once per loop: `write_back`; then, idle and `quiet` with nothing left
        to move, `probe_idle` and the save a throttled one left behind. True while more waits."""
        more = self.write_back(idle)
        if idle and quiet and not more:
            self.probe_idle()
            if self.cost_file is not None and self.cost_file.unsaved:
                self._save_costs(force=True)
        return more

    def probe_idle(self) -> None:
        """Engine thread, while idle: where the SSD's rate is unknown or due again, time reads of
        this model's most recent blocks (up to `IDLE_PROBE_BYTES`, counted as no hits), and fit the
        prefill model, so that no request pays for either (docs/design/restore-or-recompute.md)."""
        try:
            self.prefill.terms()
        except (ArithmeticError, ValueError):  # a decision that needs it logs the failure; the SSD timing goes on
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
        block_bytes = self.block_bytes
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
        use_on_device(blocks)
        upload = time.perf_counter() - tic
        nbytes = sum(b.nbytes for b in blocks)
        seconds = max(r.finished for r in reads) - min(r.started for r in reads) + upload
        self._learn_size(blocks[0])
        self.ssd_rate.forget()  # a re-probe replaces what was measured
        self.ssd_rate.observe(nbytes, seconds)
        self._save_costs(force=True)
        log.debug("%s: SSD restores timed while idle: %d bytes in %.3fs", self.model_id, nbytes, seconds)
