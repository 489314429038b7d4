"""A restore as a value (`RestorePlan`): the runs of a prompt's cached blocks per tier, which of
them pay against recomputing, the tail after them and the chain's keys. Made once per admission
by `match`; pure data, no MLX (docs/design/restore-or-recompute.md)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Tier(enum.Enum):
    """Where a run of blocks lies when the plan is made."""

    DEVICE = "device"  # device memory (the hot tier, or waiting there to leave it)
    RAM = "ram"  # the RAM tier (host memory, on a discrete GPU)
    SSD = "ssd"  # the SSD tier's files


@dataclass(frozen=True)
class Verdict:
    """Restore or recompute, and the numbers it was decided on (None: not known then)."""

    restore: bool
    restore_s: float | None = None
    recompute_s: float | None = None
    rate: float | None = None  # the tier's bytes/s judged on
    reason: str = "measured"  # or "unmeasured", "extrapolated", "probe", "held"


@dataclass(frozen=True)
class Run:
    """Consecutive blocks of the chain in one tier, from block `first` on. `probe`: the tier is
    timed on a part first and the rest judged again; `ahead`: its first `ahead` blocks are made
    ready before the request is inserted; `move`: a RAM run's rest is moved, not copied."""

    tier: Tier
    first: int
    keys: tuple[str, ...]
    verdict: Verdict
    probe: bool = False
    ahead: int = 0
    move: bool = False

    @property
    def blocks(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class Tail:
    """A stored partial block after the runs (`tier`: where it lies) and how many of its tokens the prompt uses."""

    key: str
    tokens: int
    tier: Tier


@dataclass(frozen=True)
class PrefillEstimate:
    """The fitted prefill cost when the plan was made: t ≈ c + a·n + b·n·(d + n/2) (`terms`, None before any prefill)."""

    terms: tuple[float, float, float] | None = None

    def seconds(self, tokens: int, depth: int = 0) -> float | None:
        """What `tokens` after `depth` cached ones add to a prefill (the fixed cost not included)."""
        if self.terms is None:
            return None
        _, a, b = self.terms
        return a * tokens + b * tokens * (depth + tokens / 2)


@dataclass(frozen=True)
class MissFacts:
    """What the tiers knew where a plan's full blocks end (`miss_facts.look`, read by `match`), for
    `why.explain`: the cached block or tail there sharing the most tokens with the prompt, and more."""

    shared: int = 0  # tokens that block or tail shares with the prompt there
    shared_held: bool = False  # it is still in a tier
    shared_len: int = 0  # its own tokens
    next_evicted: bool = False  # the first full block not restored was held and let go
    other_build: bool = False  # the prompt's first block is cached for another fingerprint of this model


@dataclass(frozen=True)
class RestorePlan:
    """What `prompt_tokens` would restore: `runs` from the root (device, RAM, SSD; a run judged not to pay
    ends the plan), then the first of `tails` the loader finds. `kv_only`: runs are read without their
    layers' state, the last block's read apart (docs/design/cache-kinds.md)."""

    prompt_tokens: int
    block_size: int
    keys: tuple[str, ...] = ()
    runs: tuple[Run, ...] = ()
    tails: tuple[Tail, ...] = ()
    kv_only: bool = False
    recompute: PrefillEstimate = PrefillEstimate()
    stores_after_prefill: bool = True  # false: only RAM would keep blocks, stored at the request's end
    counted: bool = True  # a request's restore (false: a paused sequence's own tokens again)
    facts: MissFacts = MissFacts()  # what the tiers knew where the restore ends (`why.explain`)

    @property
    def restored_blocks(self) -> int:
        """Full blocks the plan restores (device memory's and the runs that pay)."""
        return sum(run.blocks for run in self.runs if run.verdict.restore)

    @property
    def tokens(self) -> int:
        """Tokens the plan restores if every block is where it was: full blocks, and its best tail."""
        return self.restored_blocks * self.block_size + (self.tails[0].tokens if self.tails else 0)

    @property
    def ahead(self) -> bool:
        """Whether some run is made ready before the request is inserted."""
        return any(run.ahead for run in self.runs)

    def run_in(self, tier: Tier) -> Run | None:
        return next((run for run in self.runs if run.tier is tier), None)

    def recompute_seconds(self, tokens: int, depth: int) -> float | None:
        """What prefilling `tokens` after `depth` cached ones takes here (None: not known)."""
        return self.recompute.seconds(tokens, depth)

    def worth_storing(self, tokens: int, cached: int) -> bool:
        """Whether a prompt of `tokens` with `cached` restored has a new full block worth storing
        right after its prefill (not when only RAM would keep it: docs/design/write-back.md)."""
        return self.stores_after_prefill and self.block_size > 0 and tokens - cached >= self.block_size
