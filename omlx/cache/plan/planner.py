"""`match`: where a prompt's blocks lie (one walk of the tiers, no MLX) turned into a `RestorePlan`, its
runs judged once against recomputing (`decide`), its tail found (`tails`), the facts at its end read for
its report (`miss_facts`). Why these rules: docs/design/restore-or-recompute.md, ram-moves.md."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from omlx.cache.block.hashing import ExtraKeys, block_keys
from omlx.cache.plan import decide, miss_facts
from omlx.cache.plan.decide import Costs, Rate
from omlx.cache.plan.restore_plan import MissFacts, RestorePlan, Run, Tier, Verdict
from omlx.cache.plan.tail_index import TailIndex
from omlx.cache.plan.tails import find_tails

# A slower tier's run of at least this many bytes is made ready ahead of the request's insert (an SSD
# run read on reader threads, a RAM run moved a chunk per engine loop); smaller ones in line.
AHEAD_MIN_BYTES = 16 << 20


class ChainView(Protocol):
    """What the planner reads of the tiers (each answer under the tiers' lock, no file reads once indexed);
    it is a `TailView` too."""

    def held(self, keys: list[str]) -> set[str] | None: ...

    def tier_of(self, key: str, fingerprint: str, device_only: bool) -> Tier | None: ...

    def on_device(self, key: str) -> bool: ...

    def ram_bytes(self, key: str) -> int: ...

    def on_ssd(self, key: str, fingerprint: str) -> bool: ...

    def device_can_hold(self, nbytes: int) -> bool: ...

    def device_bytes(self) -> int: ...

    def has_ram(self) -> bool: ...

    def has_ssd(self) -> bool: ...

    def evicted(self, key: str) -> bool: ...


@dataclass(frozen=True)
class Measured:
    """The measurements a plan is judged on, read once at `match`; `block_bytes`: a whole block's (0: none seen)."""

    costs: Costs = Costs()
    ssd: Rate = Rate()
    ram_move: Rate = Rate()
    ram_copy: Rate = Rate()
    block_bytes: int = 0


@dataclass
class Planner:
    """One model's `match` over the shared tiers (`view`), its blocks keyed by `fingerprint`; `kv_only`
    and `whole_tails` for a model with stateful layers (docs/design/cache-kinds.md)."""

    view: ChainView
    fingerprint: str
    block_size: int
    kv_only: bool = False
    whole_tails: bool = False
    tails: TailIndex = field(default_factory=TailIndex)
    others: miss_facts.OtherBuilds = list  # this model's other builds (a miss's `fingerprint` reason)

    def match(
        self, tokens: list[int], measured: Measured, grid: int = 0, resumed: bool = False,
        image_keys: ExtraKeys | None = None,
    ) -> RestorePlan:
        """The plan for `tokens` (at least one token is left to compute); `grid`: the engine's prefill
        grid, a restored prefix is used only up to a multiple of it; `resumed`: not a new request's;
        `image_keys`: `block_keys`' extra keys (each image's digest at its first token)."""
        size, limit = self.block_size, len(tokens) - 1
        keys = block_keys(self.fingerprint, tokens, size, image_keys)
        chain = Chain(keys[: max(0, limit) // size], size, self.kv_only)
        runs = plan_runs(self.view, self.fingerprint, chain, measured)
        blocks = sum(run.blocks for run in runs if run.verdict.restore)
        skipped = any(not run.verdict.restore for run in runs)
        tails = find_tails(
            self.view, self.tails, self.fingerprint, tokens, keys[:blocks], size, grid,
            device_only=skipped, whole=self.whole_tails, image_keys=image_keys,
        )  # fmt: skip
        facts = MissFacts()  # a run judged not to pay is the reason: nothing else to read
        if not skipped:
            used = tails[0].tokens if tails else 0
            facts = miss_facts.look(
                self.view, self.tails, self.others, self.fingerprint, tokens, keys, blocks, size, used, image_keys
            )
        ram_only = self.view.has_ram() and measured.block_bytes > 0 and not self.view.device_can_hold(measured.block_bytes)
        return RestorePlan(
            len(tokens), size, tuple(keys), runs, tails, self.kv_only, measured.costs.prefill,
            stores_after_prefill=not ram_only, counted=not resumed, facts=facts,
        )  # fmt: skip


@dataclass(frozen=True)
class Chain:
    """The full blocks a restore may take (`keys`, within the prompt's limit), of `block_size` tokens."""

    keys: list[str]
    block_size: int
    kv_only: bool = False


def run_of(keys: list[str], start: int, holds: Callable[[str], bool]) -> list[str]:
    """The keys from `keys[start]` on that `holds` is true of, up to the first it is not."""
    run = []
    for key in keys[start:]:
        if not holds(key):
            break
        run.append(key)
    return run


def plan_runs(view: ChainView, fingerprint: str, chain: Chain, measured: Measured) -> tuple[Run, ...]:
    """The chain's runs from the root: device memory's, then RAM's, then the SSD's, each judged;
    a run that does not pay ends them (nothing behind it is read)."""
    keys = chain.keys
    device = run_of(keys, 0, view.on_device)
    runs = [Run(Tier.DEVICE, 0, tuple(device), Verdict(True, reason="held"))] if device else []
    at = len(device)
    if view.has_ram():
        sizes: list[int] = []
        for key in keys[at:]:
            size = view.ram_bytes(key)
            if not size:
                break
            sizes.append(size)
        if sizes:
            run = ram_run(view, chain, at, sizes, measured)
            runs.append(run)
            if not run.verdict.restore:
                return tuple(runs)
            at += run.blocks
    if view.has_ssd():
        ssd = run_of(keys, at, lambda k: view.on_ssd(k, fingerprint))
        if ssd:
            runs.append(ssd_run(chain, at, ssd, measured))
    return tuple(runs)


def ram_run(view: ChainView, chain: Chain, first: int, sizes: list[int], measured: Measured) -> Run:
    """A RAM run (its blocks' `sizes`): its first part moved ahead where large and measured (at most half
    the hot tier, which it must not push out again), the rest moved when the hot tier can keep it, else
    copied; a stateful model's copied KV-only (its states never reach the device)."""
    keys = tuple(chain.keys[first : first + len(sizes)])
    tokens, depth = len(keys) * chain.block_size, first * chain.block_size
    if chain.kv_only:
        rate = measured.ram_copy
        return judged(Run(Tier.RAM, first, keys, Verdict(True)), tokens, depth, rate, measured)
    ahead = 0
    if measured.ram_move.value is not None and measured.block_bytes and sum(sizes) >= AHEAD_MIN_BYTES:
        ahead = min(len(keys), view.device_bytes() // 2 // measured.block_bytes)
    move = view.device_can_hold(sum(sizes[ahead:]))
    rate = measured.ram_move if ahead or move else measured.ram_copy
    return judged(Run(Tier.RAM, first, keys, Verdict(True), ahead=ahead, move=move), tokens, depth, rate, measured)


def ssd_run(chain: Chain, first: int, keys: list[str], measured: Measured) -> Run:
    """An SSD run, read ahead on reader threads where large and measured."""
    tokens, depth = len(keys) * chain.block_size, first * chain.block_size
    run = Run(Tier.SSD, first, tuple(keys), Verdict(True))
    large = measured.block_bytes > 0 and measured.costs.restore_bytes(tokens) >= AHEAD_MIN_BYTES
    if measured.ssd.value is not None and large:
        run = Run(Tier.SSD, first, tuple(keys), Verdict(True), ahead=len(keys))
    return judged(run, tokens, depth, measured.ssd, measured)


def judged(run: Run, tokens: int, depth: int, rate: Rate, measured: Measured) -> Run:
    """`run` with its verdict: a tier due a timing is probed in line (nothing ahead), else `decide.verdict`."""
    if decide.due_probe(rate, measured.costs):
        return Run(run.tier, run.first, run.keys, Verdict(True, rate=rate.value, reason="probe"), probe=True, move=run.move)
    verdict = decide.verdict(tokens, depth, rate, measured.costs)
    ahead = run.ahead if verdict.restore else 0
    return Run(run.tier, run.first, run.keys, verdict, ahead=ahead, move=run.move)
