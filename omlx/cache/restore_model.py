"""Restore or recompute: whether a run of cached blocks on a slower tier is worth restoring,
judged from each tier's measured rate against the fitted prefill cost. No MLX here; the
reasons and their measurements are in docs/design/restore-or-recompute.md."""

from __future__ import annotations

import logging
from typing import Any

from omlx.cache.prefill_cost import PrefillCost

log = logging.getLogger("omlx.cache")

# A slow tier is restored from only when its estimate beats recomputing by this factor: a
# restore from host memory varies more than a prefill, so close calls recompute.
RESTORE_MARGIN = 0.8
# The first restore from a tier never measured times a part of the run first: up to an eighth
# of it, in groups of 1, 2, 4 ... blocks, while that is expected to stay within this share of
# recomputing the whole run.
PROBE_SHARE = 0.1
# A tier judged slower than recomputing this many times in a row is probed again the same way,
# so one slow measurement (a disk busy with another process) does not turn it off for good.
REPROBE_AFTER = 16
# A RAM-move run this many times the mean size of the moves measured is restored: each move has
# a fixed cost, so the rate grows with the size (docs/design/restore-or-recompute.md).
EXTRAPOLATION = 8
# A restore of at least `RESET_BYTES` that ran below this share of a tier's estimate replaces its
# history: the page cache served what was measured before, the disk serves it now (a restart, memory
# pressure), and a byte-weighted history of large fast restores would outvote the slow one.
SLOW_RESET = 0.5
RESET_BYTES = 16 << 20


class Throughput:
    """A tier's restore rate in bytes/s: decayed bytes over decayed seconds, so each restore
    counts by its size (a one-block probe must not outvote a whole run)."""

    def __init__(self, decay: float = 0.7, grows_with_size: bool = False):
        self.decay = decay
        self.grows_with_size = grows_with_size  # a fixed cost per restore: larger ones run faster per byte
        self._bytes = 0.0
        self._seconds = 0.0
        self._count = 0.0  # decayed number of restores measured
        self.skipped = 0  # restores judged slower than recomputing since the last measurement

    @property
    def value(self) -> float | None:
        return self._bytes / self._seconds if self._seconds > 0 else None

    def observe(self, amount: float, seconds: float) -> None:
        """One restore of `amount` bytes in `seconds`; a large one far slower than the estimate
        replaces the history (`SLOW_RESET`), except where the rate grows with the size."""
        if seconds <= 0 or amount <= 0:
            return
        value = self.value
        if not self.grows_with_size and value is not None and amount >= RESET_BYTES and amount / seconds < SLOW_RESET * value:
            self.forget()
        self._bytes = self.decay * self._bytes + amount
        self._seconds = self.decay * self._seconds + seconds
        self._count = self.decay * self._count + 1
        self.skipped = 0

    def extrapolates(self, amount: float) -> bool:
        """Whether the rate grows with the size and `amount` is over `EXTRAPOLATION` times the
        mean size of the restores measured."""
        return self.grows_with_size and self._count > 0 and amount > EXTRAPOLATION * self._bytes / self._count

    def forget(self) -> None:
        """Drop what was measured (a probe is to replace it)."""
        self._bytes = self._seconds = self._count = 0.0

    def state(self) -> list[float]:
        return [self._bytes, self._seconds, self._count]

    def load(self, state: Any) -> None:
        """A saved `state`; one of two numbers (before the count) counts as one restore."""
        if state is not None:
            values = [float(x) for x in state]
            self._bytes, self._seconds = values[:2]
            self._count = values[2] if len(values) > 2 else 1.0

    @property
    def stale(self) -> bool:
        """Never measured, or judged slower `REPROBE_AFTER` times in a row: to be timed again."""
        return self.value is None or self.skipped >= REPROBE_AFTER


class RestoreModel:
    """One model's restore-or-recompute measurements: its prefill cost on this device, the
    restore rates of the SSD, of moves from RAM and of copies from RAM, and its KV bytes per
    token; `judge` weighs a run's restore against recomputing it at its depth."""

    def __init__(self, model_id: str = "", attention: float | None = None):
        self.model_id = model_id
        self.prefill = PrefillCost(prior=attention)  # `attention`: the model's b/a
        self.ssd_rate = Throughput()  # bytes/s of SSD restores
        self.warm_rate = Throughput(grows_with_size=True)  # ... of restores moved from host RAM (the warm tier)
        self.warm_copy_rate = (
            Throughput()
        )  # ... and copied from it (a run the hot tier cannot keep)
        self.bytes_per_token = 0
        # stateful layers (docs/design/cache-kinds.md): each block also holds their whole state,
        # the same size at any length, and a restore reads only its last block's; `block_size`:
        # tokens per full block (0: no such layers)
        self.state_bytes = 0
        self.block_size = 0

    def learn_size(self, nbytes: int, tokens: int, state_bytes: int = 0) -> None:
        """The KV bytes per token and the bytes of a block's whole state (`state_bytes` of its
        `nbytes`), from the first whole block seen (never a partial read: it lacks a part)."""
        if not self.bytes_per_token and not self.state_bytes:
            self.bytes_per_token = (nbytes - state_bytes) // max(1, tokens)
            self.state_bytes = state_bytes

    def restore_bytes(self, n_tokens: int) -> int:
        """What restoring `n_tokens` from a slower tier reads: their KV, and one state (the last
        block's, whatever the run's length) where the model has stateful layers."""
        state = self.state_bytes if n_tokens > 0 and self.block_size else 0
        return n_tokens * self.bytes_per_token + state

    def due_probe(self, rate: Throughput) -> bool:
        """Whether a restore from that tier times a part of its run first: the tier is stale
        and the recompute side is known."""
        return rate.stale and self.prefill.observations > 0

    def probe_budget(self, n_tokens: int, depth: int) -> float:
        """The seconds a probe of a run may take: `PROBE_SHARE` of recomputing it."""
        return PROBE_SHARE * (self.prefill.seconds(n_tokens, depth) or 0.0)

    def pays(self, n_tokens: int, depth: int, rate: Throughput) -> bool:
        """Restore `n_tokens` from a tier (its measured bytes/s) only when that clearly beats
        recomputing them after the `depth` tokens before them (`RESTORE_MARGIN`); logged."""
        pays, why = self.judge(n_tokens, depth, rate)
        log_judgement(why)
        return pays

    def judge(
        self, n_tokens: int, depth: int, rate: Throughput
    ) -> tuple[bool, tuple[Any, ...] | None]:
        """`pays`' verdict, and its debug line's arguments (None when not logged)."""
        recompute_s = self.prefill.seconds(n_tokens, depth)
        if recompute_s is None or rate.value is None or not self.restore_bytes(n_tokens):
            return True, None  # no measurement yet: restoring is how we get one
        if rate.extrapolates(self.restore_bytes(n_tokens)):
            log.debug("%s: %d tokens at depth %d from %s, past %dx the sizes its rate is known for: restore",
                      self.model_id, n_tokens, depth, self.tier_name(rate), EXTRAPOLATION)  # fmt: skip
            return True, None
        restore_s = self.restore_bytes(n_tokens) / rate.value
        pays = restore_s < RESTORE_MARGIN * recompute_s
        if not log.isEnabledFor(logging.DEBUG):
            return pays, None
        c, a, b = self.prefill.terms()
        return pays, (
            self.model_id, n_tokens, depth, self.tier_name(rate), restore_s, rate.value / 1e9, recompute_s,
            "restore" if pays else "recompute", c, a, b,
        )  # fmt: skip

    def tier_name(self, rate: Throughput) -> str:
        return (
            "SSD"
            if rate is self.ssd_rate
            else "RAM moves"
            if rate is self.warm_rate
            else "RAM copies"
        )

    def state(self) -> dict[str, Any]:
        """What outlives the process (`cost_file.CostFile`)."""
        return {
            "prefill": self.prefill.state(),
            "ssd_restores": self.ssd_rate.state(),  # [bytes, seconds], decayed
            "warm_moves": self.warm_rate.state(),
            "warm_copies": self.warm_copy_rate.state(),
            "bytes_per_token": self.bytes_per_token,
            "state_bytes": self.state_bytes,
        }

    def load(self, state: dict[str, Any]) -> None:
        """A saved `state` back; raises KeyError, TypeError or ValueError on a bad one."""
        self.prefill.load(state["prefill"])
        self.ssd_rate.load(state.get("ssd_restores"))
        self.warm_rate.load(state.get("warm_moves"))
        # files of an older format kept only copies from RAM, as "warm_restores"
        self.warm_copy_rate.load(state.get("warm_copies") or state.get("warm_restores"))
        self.bytes_per_token = int(state.get("bytes_per_token") or 0)
        self.state_bytes = int(state.get("state_bytes") or 0)


def log_judgement(why: tuple[Any, ...] | None) -> None:
    """The debug line of a restore-or-recompute decision (`RestoreModel.judge`)."""
    if why is not None:
        log.debug(
            "%s: %d tokens at depth %d from %s: restore %.3fs (%.2f GB/s) vs recompute %.3fs: %s"
            " (prefill fit: %.4fs + %.3gs/token + %.3gs/token/context token)",
            *why,
        )
