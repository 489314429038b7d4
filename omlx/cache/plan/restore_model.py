"""The measurements restore-or-recompute weighs (`RestoreModel`): this device's prefill cost, each
slower tier's restore rate and a block's sizes, read into a `Measured` for `match`, and the verdict's
debug line. No MLX; the reasons are in docs/design/restore-or-recompute.md."""

from __future__ import annotations

import logging
from typing import Any

from omlx.cache.plan.decide import EXTRAPOLATION, REPROBE_AFTER, Costs, Rate
from omlx.cache.plan.planner import Measured
from omlx.cache.plan.prefill_cost import PrefillCost
from omlx.cache.plan.restore_plan import Verdict

log = logging.getLogger("omlx.cache")

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
        mean = self.snapshot().mean_bytes
        return mean is not None and amount > EXTRAPOLATION * mean

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

    def snapshot(self) -> Rate:
        """The rate as `decide` weighs it now."""
        grows = self.grows_with_size and self._count > 0
        return Rate(self.value, self.stale, self._bytes / self._count if grows else None)


class RestoreModel:
    """One model's restore-or-recompute measurements: its prefill cost on this device, the restore
    rates of the SSD, of moves from RAM and of copies from RAM, its KV bytes per token and, with
    stateful layers (`stateful`), the bytes of the one state a restore reads."""

    def __init__(self, model_id: str = "", attention: float | None = None, stateful: bool = False):
        self.model_id = model_id
        self.prefill = PrefillCost(prior=attention)  # `attention`: the model's b/a
        self.ssd_rate = Throughput()  # bytes/s of SSD restores
        self.ram_move_rate = Throughput(grows_with_size=True)  # ... of runs moved from RAM into device memory
        self.ram_copy_rate = Throughput()  # ... and copied from it (a run the hot tier cannot keep)
        self.bytes_per_token = 0
        self.state_bytes = 0
        self.stateful = stateful

    def learn_size(self, nbytes: int, tokens: int, state_bytes: int = 0) -> None:
        """The KV bytes per token and the bytes of a block's whole state (`state_bytes` of its
        `nbytes`), from the first whole block seen (never a partial read: it lacks a part)."""
        if not self.bytes_per_token and not self.state_bytes:
            self.bytes_per_token = (nbytes - state_bytes) // max(1, tokens)
            self.state_bytes = state_bytes

    def costs(self) -> Costs:
        """What a verdict weighs besides a rate, now."""
        estimate = self.prefill.estimate()
        return Costs(estimate, self.bytes_per_token, self.state_bytes, self.stateful)

    def restore_bytes(self, tokens: int) -> int:
        """What restoring `tokens` from a slower tier reads: their KV, and one state where stateful."""
        return Costs(bytes_per_token=self.bytes_per_token, state_bytes=self.state_bytes, stateful=self.stateful).restore_bytes(tokens)

    def measured(self, block_size: int) -> Measured:
        """Everything `match` weighs, read once (a whole block being `block_size` tokens)."""
        return Measured(
            self.costs(), self.ssd_rate.snapshot(), self.ram_move_rate.snapshot(), self.ram_copy_rate.snapshot(),
            self.restore_bytes(block_size),
        )  # fmt: skip

    def tier_name(self, rate: Throughput | None) -> str:
        return "SSD" if rate is self.ssd_rate else "RAM moves" if rate is self.ram_move_rate else "RAM copies"

    def log_verdict(self, tokens: int, depth: int, rate: Throughput, verdict: Verdict) -> None:
        """The debug line of one restore-or-recompute decision (once per decision carried out)."""
        if not log.isEnabledFor(logging.DEBUG) or verdict.reason in ("unmeasured", "held", "probe"):
            return
        tier = self.tier_name(rate)
        if verdict.reason == "extrapolated":
            log.debug("%s: %d tokens at depth %d from %s, past %dx the sizes its rate is known for: restore",
                      self.model_id, tokens, depth, tier, EXTRAPOLATION)  # fmt: skip
            return
        c, a, b = self.prefill.terms()
        log.debug(
            "%s: %d tokens at depth %d from %s: restore %.3fs (%.2f GB/s) vs recompute %.3fs: %s"
            " (prefill fit: %.4fs + %.3gs/token + %.3gs/token/context token)",
            self.model_id, tokens, depth, tier, verdict.restore_s, (verdict.rate or 0.0) / 1e9, verdict.recompute_s,
            "restore" if verdict.restore else "recompute", c, a, b,
        )  # fmt: skip

    def state(self) -> dict[str, Any]:
        """What outlives the process (`cost_file.CostFile`); the file's keys predate the RAM tier's name."""
        return {
            "prefill": self.prefill.state(),
            "ssd_restores": self.ssd_rate.state(),  # [bytes, seconds, count], decayed
            "warm_moves": self.ram_move_rate.state(),
            "warm_copies": self.ram_copy_rate.state(),
            "bytes_per_token": self.bytes_per_token,
            "state_bytes": self.state_bytes,
        }

    def load(self, state: dict[str, Any]) -> None:
        """A saved `state` back; raises KeyError, TypeError or ValueError on a bad one."""
        self.prefill.load(state["prefill"])
        self.ssd_rate.load(state.get("ssd_restores"))
        self.ram_move_rate.load(state.get("warm_moves"))
        # files of an older format kept only copies from RAM, as "warm_restores"
        self.ram_copy_rate.load(state.get("warm_copies") or state.get("warm_restores"))
        self.bytes_per_token = int(state.get("bytes_per_token") or 0)
        self.state_bytes = int(state.get("state_bytes") or 0)
