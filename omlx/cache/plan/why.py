"""Why a prompt's tokens were (or would be) restored or computed: `explain` turns a `RestorePlan` (with the
facts `match` read where it ends) and what the loader made of it (`Outcome`) into a `CacheReport`. Pure
functions, no MLX, no I/O; the reasons and their limits: docs/design/cache-explain.md."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from omlx.cache.plan.restore_plan import RestorePlan, Tier

# the tiers as the server names them everywhere (`/api/cache/stats`, /metrics' `tier` label)
TIER_NAMES = {Tier.DEVICE: "hot", Tier.RAM: "ram", Tier.SSD: "ssd"}


class Reason(enum.Enum):
    """Why the tokens after the restored prefix were computed (the first cause, where the restore ends)."""

    NONE = "none"  # all was restored but the tokens a prefill must compute (the last one)
    DISABLED = "disabled"  # this model is served without the prefix cache
    NO_PREFIX = "no_prefix"  # nothing cached goes on from there: new tokens
    EVICTED = "evicted"  # a block or tail held there was let go for room
    DIVERGED = "diverged"  # a cached prompt goes on from there with other tokens (a changed history)
    TEMPLATE = "template"  # diverged where the chat template rewrote a turn this server generated
    FINGERPRINT = "fingerprint"  # the prompt's first block is cached for another build of this model
    SLOWER = "slower"  # a restore judged slower than recomputing (or a read-ahead cut short as such)
    NO_STATE = "no_state"  # cached tokens go on, but a stateful model has no layer state there
    GRAIN = "grain"  # cached tokens go on inside a block, fewer than a restore uses (grid, short tail)
    GRID = "grid"  # the restored prefix was cut back onto the engine's prefill grid
    GONE = "gone"  # a planned block left every tier between the plan and the restore


@dataclass(frozen=True)
class Outcome:
    """What the loader made of the plan: (tier, tokens, bytes) per block in chain order, `unfit` tokens before
    the grid fit, why a run stopped short (read-ahead `cut`, a last state gone: `no_state`, a probe showing
    the rest slower: `probed_slower`), and the seconds each slower tier's restore took."""

    parts: tuple[tuple[Tier, int, int], ...] = ()
    unfit: int = 0
    cut: bool = False
    no_state: bool = False
    probed_slower: bool = False
    seconds: tuple[tuple[Tier, float], ...] = ()  # restore seconds per slower tier, as the loader timed them


@dataclass(frozen=True)
class TierShare:
    tokens: int = 0
    bytes: int | None = None  # None: not read (a plan not carried out)
    seconds: float | None = None  # the restore's time from a RAM or SSD tier (None: device memory, or not read)


@dataclass(frozen=True)
class CacheReport:
    """One prompt's restore: `cached` of `prompt_tokens` tokens restored, by tier (`tiers`), the rest
    computed for `reason` (`detail`: a sentence with the numbers)."""

    prompt_tokens: int
    cached: int
    tiers: dict[str, TierShare] = field(default_factory=dict)
    reason: Reason = Reason.NONE
    detail: str = ""

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.cached

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (usage's `omlx.cache`, `POST /api/cache/explain`)."""
        return {
            "cached_tokens": self.cached,
            "computed_tokens": self.computed,
            "tiers": {
                t: {"tokens": s.tokens, "bytes": s.bytes, "seconds": None if s.seconds is None else round(s.seconds, 6)}
                for t, s in self.tiers.items()
            },
            "reason": self.reason.value,
            "detail": self.detail,
        }

    def log_fields(self) -> str:
        """`restored=hot:512,ssd:256 computed=300:evicted` for the request's log line."""
        tiers = ",".join(f"{t}:{s.tokens}" for t, s in self.tiers.items() if s.tokens) or "-"
        return f"restored={tiers} computed={self.computed}:{self.reason.value}"


def outcome(loading: Any) -> Outcome:
    """What a `Loading` (carried out by `cache_for`) made of its plan."""
    parts = tuple(loading.parts)
    seconds = tuple(loading.seconds.items())
    return Outcome(parts, sum(p[1] for p in parts), loading.cut, loading.lost_state, loading.probed_slower, seconds)


def shares(
    parts: tuple[tuple[Tier, int, int], ...], cached: int, seconds: tuple[tuple[Tier, float], ...] = ()
) -> dict[str, TierShare]:
    """Tokens and bytes per tier of the first `cached` tokens of `parts` (a part cut short by the grid
    fit counts its bytes whole: they were read), with the `seconds` each tier's restore took."""
    out: dict[str, list[int]] = {}
    left = cached
    for tier, tokens, nbytes in parts:
        if left <= 0:
            break
        entry = out.setdefault(TIER_NAMES[tier], [0, 0])
        entry[0] += min(tokens, left)
        entry[1] += nbytes
        left -= tokens
    spent = {TIER_NAMES[tier]: s for tier, s in seconds}
    return {t: TierShare(n, b, spent.get(t)) for t, (n, b) in out.items()}


def planned_shares(plan: RestorePlan) -> dict[str, TierShare]:
    """Tokens per tier the plan would restore (nothing read: no bytes)."""
    out: dict[str, int] = {}
    for run in plan.runs:
        if run.verdict.restore:
            name = TIER_NAMES[run.tier]
            out[name] = out.get(name, 0) + run.blocks * plan.block_size
    if plan.tails:
        name = TIER_NAMES[plan.tails[0].tier]
        out[name] = out.get(name, 0) + plan.tails[0].tokens
    return {t: TierShare(n) for t, n in out.items()}


def explain(plan: RestorePlan, outcome: Outcome | None = None, cached: int | None = None) -> CacheReport:
    """The report for `plan`: as carried out (`outcome`, `cached` after the grid fit) or, without them,
    as it would be. The reason is the first cause at the end of what was restored."""
    total, facts = plan.prompt_tokens, plan.facts
    if plan.block_size <= 0:
        return CacheReport(total, 0, {}, Reason.DISABLED, "this model is served without the prefix cache")
    planned = min(plan.tokens, max(0, total - 1))
    got = planned if cached is None else cached
    tiers = planned_shares(plan) if outcome is None else shares(outcome.parts, got, outcome.seconds)

    def report(reason: Reason, detail: str) -> CacheReport:
        return CacheReport(total, got, tiers, reason, detail)

    if got >= total - 1:
        return report(Reason.NONE, "all but the last token restored: a prefill computes at least one")
    if outcome is not None and got < planned:
        return _short(outcome, got, planned, report)
    skipped = next((run for run in plan.runs if not run.verdict.restore), None)
    if skipped is not None:
        v = skipped.verdict
        return report(
            Reason.SLOWER,
            f"{skipped.blocks * plan.block_size} tokens in {TIER_NAMES[skipped.tier]}: restoring them was judged slower "
            f"({_s(v.restore_s)}) than recomputing them ({_s(v.recompute_s)})",
        )  # fmt: skip
    n = plan.restored_blocks * plan.block_size
    used = plan.tails[0].tokens if plan.tails else 0
    if n == 0 and used == 0 and facts.other_build:
        return report(
            Reason.FINGERPRINT,
            "the prompt's first block is cached for another build of this model (weights, dtype, KV format "
            "or block size changed): those blocks can never be served",
        )  # fmt: skip
    shared = min(facts.shared, total - 1 - n)
    if shared > used:
        if not facts.shared_held:
            return report(Reason.EVICTED, f"a cached block shared tokens up to {n + shared}, and was let go for room")
        if plan.kv_only:
            return report(
                Reason.NO_STATE,
                f"cached tokens go on to {n + shared}, but this model's window or recurrent layers keep a state only "
                f"at a stored block's end ({n + facts.shared_len})",
            )  # fmt: skip
        return report(
            Reason.GRAIN,
            f"cached tokens go on to {n + shared} inside a block, fewer than a restore uses there "
            "(the prefill grid, or a partial block alone under its minimum)",
        )  # fmt: skip
    if facts.next_evicted:
        return report(Reason.EVICTED, f"the block at token {n} was cached and let go for room")
    if facts.shared_len > shared == used:  # the restore ends where a cached block parts from the prompt
        return report(
            Reason.DIVERGED,
            f"a cached prompt goes on from token {n + shared} with other tokens ({facts.shared_len - shared} of its "
            "block differ): the history differs from what was cached",
        )  # fmt: skip
    return report(Reason.NO_PREFIX, f"nothing cached goes on from token {n + used}: new tokens")


def template_rewrote(report: CacheReport | None, turns: int) -> CacheReport | None:
    """`report`, its `diverged` named as the chat template's doing where the request's template rewrote
    `turns` earlier answers this server generated (the chat pipeline knows; the cache cannot)."""
    if report is None or turns <= 0 or report.reason is not Reason.DIVERGED:
        return report
    why = f"the chat template rewrote {turns} earlier assistant turn(s) sent back as generated (e.g. it drops past reasoning)"
    return replace(report, reason=Reason.TEMPLATE, detail=f"{why}; {report.detail}")


def _short(outcome: Outcome, got: int, planned: int, report: Callable[[Reason, str], CacheReport]) -> CacheReport:
    """Why fewer tokens were restored than planned."""
    if outcome.cut:
        return report(Reason.SLOWER, f"the SSD read-ahead ran slower than recomputing and was cut short after {got} tokens")
    if outcome.probed_slower:
        return report(Reason.SLOWER, "a tier timed on part of its run showed the rest slower than recomputing")
    if outcome.no_state:
        return report(Reason.NO_STATE, "no tier held the layer state of the prefix's last block any more")
    if outcome.unfit > got:
        return report(Reason.GRID, f"{outcome.unfit} tokens restored, cut back to {got} on the prefill grid")
    return report(Reason.GONE, f"{planned} tokens planned; a block left every tier before it was restored")


def _s(seconds: float | None) -> str:
    return "unknown" if seconds is None else f"{seconds:.3f}s"


def plan_dict(plan: RestorePlan) -> dict[str, Any]:
    """The plan's runs and tail as JSON (`POST /api/cache/explain`)."""
    size = plan.block_size
    return {
        "block_size": size,
        "runs": [
            {
                "tier": TIER_NAMES[run.tier], "first_token": run.first * size, "tokens": run.blocks * size,
                "restore": run.verdict.restore, "why": run.verdict.reason, "probe": run.probe,
                "restore_s": run.verdict.restore_s, "recompute_s": run.verdict.recompute_s,
                "rate_bytes_per_s": run.verdict.rate,
            }  # fmt: skip
            for run in plan.runs
        ],
        "tail": {"tier": TIER_NAMES[plan.tails[0].tier], "tokens": plan.tails[0].tokens} if plan.tails else None,
    }
