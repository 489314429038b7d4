"""Restore or recompute as pure functions of a run and measured numbers (no MLX, no I/O, no
clock): whether a run pays, whether a tier is timed first, and whether reads under way still
pay (the cut). Reasons and measurements: docs/design/restore-or-recompute.md."""

from __future__ import annotations

from dataclasses import dataclass

from omlx.cache.plan.restore_plan import PrefillEstimate, Verdict

# A slow tier is restored from only when its estimate beats recomputing by this factor: a
# restore from host memory varies more than a prefill, so close calls recompute.
RESTORE_MARGIN = 0.8
# Reads already under way go on while the rest restores no slower than it recomputes: what was
# read is paid for, so only a clear loss cuts them (`ReadWatch`).
KEEP_READING_MARGIN = 1.0
# The first restore from a tier never measured times a part of the run first: up to an eighth
# of it, in groups of 1, 2, 4 ... blocks, while that is expected to stay within this share of
# recomputing the whole run.
PROBE_SHARE = 0.1
PROBE_PART = 8
# A tier judged slower than recomputing this many times in a row is probed again the same way,
# so one slow measurement (a disk busy with another process) does not turn it off for good.
REPROBE_AFTER = 16
# A RAM-move run this many times the mean size of the moves measured is restored: each move has
# a fixed cost, so the rate grows with the size.
EXTRAPOLATION = 8


@dataclass(frozen=True)
class Rate:
    """A tier's restore rate at one moment: bytes/s (None: never measured), whether it is due a
    timing, and, where the rate grows with the size (RAM moves), the mean bytes measured."""

    value: float | None = None
    stale: bool = True
    mean_bytes: float | None = None


@dataclass(frozen=True)
class Costs:
    """What a verdict weighs besides the rate: the prefill estimate, KV bytes per token and, for a
    model with stateful layers, the one state a restore reads (`state_bytes`, `stateful`)."""

    prefill: PrefillEstimate = PrefillEstimate()
    bytes_per_token: int = 0
    state_bytes: int = 0
    stateful: bool = False

    def restore_bytes(self, tokens: int) -> int:
        """What restoring `tokens` from a slower tier reads: their KV, and one state where stateful."""
        return tokens * self.bytes_per_token + (self.state_bytes if tokens > 0 and self.stateful else 0)


def verdict(tokens: int, depth: int, rate: Rate, costs: Costs) -> Verdict:
    """Restore `tokens` from a tier only when that clearly beats recomputing them after the `depth`
    tokens before them (`RESTORE_MARGIN`); with nothing to weigh yet, restore (that is how it is measured)."""
    recompute_s = costs.prefill.seconds(tokens, depth)
    nbytes = costs.restore_bytes(tokens)
    if recompute_s is None or rate.value is None or not nbytes:
        return Verdict(True, recompute_s=recompute_s, rate=rate.value, reason="unmeasured")
    if rate.mean_bytes is not None and nbytes > EXTRAPOLATION * rate.mean_bytes:
        return Verdict(True, recompute_s=recompute_s, rate=rate.value, reason="extrapolated")
    restore_s = nbytes / rate.value
    return Verdict(restore_s < RESTORE_MARGIN * recompute_s, restore_s, recompute_s, rate.value)


def due_probe(rate: Rate, costs: Costs) -> bool:
    """Whether a restore from that tier times a part of its run first: the tier is stale and the recompute side is known."""
    return rate.stale and costs.prefill.terms is not None


def probe_budget(tokens: int, depth: int, costs: Costs) -> float:
    """The seconds a probe of a run of `tokens` may take: `PROBE_SHARE` of recomputing it."""
    return PROBE_SHARE * (costs.prefill.seconds(tokens, depth) or 0.0)


def probe_blocks(blocks: int) -> int:
    """At most how many blocks of a run a probe reads: an eighth, one at least."""
    return max(1, blocks // PROBE_PART)


def next_probe_group(seconds: float, done: int, group: int, budget: float) -> bool:
    """Whether a probe that took `seconds` for `done` blocks reads its next `group` within `budget`."""
    return seconds * (done + group) / max(1, done) <= budget


def keeps_reading(rest_s: float, recompute_s: float) -> bool:
    """Whether reads under way go on: the blocks left restore no slower than recomputing them."""
    return rest_s <= KEEP_READING_MARGIN * recompute_s


def takes_what_was_read(nbytes: int, move_rate: float | None, recompute_s: float | None) -> bool:
    """Whether the `nbytes` a cut read-ahead had read are restored: moving them into device memory
    costs no more than recomputing them (either side unknown: they are)."""
    return not move_rate or recompute_s is None or nbytes / move_rate <= recompute_s
