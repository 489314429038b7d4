"""One model's prefix cache (`PrefixCacheInterface`): `match` plans a restore (`plan/`), the loader
carries it out (`loader/`), the saver stores and writes back (`saver/`), all over the tiers every model
shares (`tiers/`); and `make_prefix_cache`, which the engine pool calls as a model loads."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from omlx.cache.block.hashing import ExtraKeys, model_fingerprint, weights_digest
from omlx.cache.block.kinds import CacheKinds, flatten, model_kinds
from omlx.cache.interface import BlockSpec, Fit, NoCache, PrefixCacheInterface
from omlx.cache.loader.idle_probe import IdleProbe
from omlx.cache.loader.loader import Loader
from omlx.cache.loader.loading import Loading
from omlx.cache.model_shapes import attention_ratio
from omlx.cache.plan import why
from omlx.cache.plan.cost_file import CostFile
from omlx.cache.plan.planner import Planner
from omlx.cache.plan.restore_model import RestoreModel
from omlx.cache.plan.restore_plan import RestorePlan
from omlx.cache.plan.tail_index import TailIndex
from omlx.cache.saver.blocks import BlockCutter
from omlx.cache.saver.saver import Saver
from omlx.cache.saver.write_back import WriteBack
from omlx.cache.tiers.tiers import Tiers

log = logging.getLogger("omlx.cache")

__all__ = ["PrefixCache", "make_prefix_cache"]


class PrefixCache:
    """One model's prefix cache (`fingerprint`, `num_layers` leaves, its layer `kinds`) over the shared `tiers`,
    in blocks of `block_size` tokens (0: the tiers'); its engine's thread calls every member."""

    def __init__(
        self,
        tiers: Tiers,
        fingerprint: str,
        num_layers: int,
        model_id: str,
        attention: float | None = None,
        kinds: CacheKinds | None = None,
        block_size: int = 0,
    ) -> None:
        kinds = kinds if kinds is not None and not kinds.plain_kv else None  # plain KV: blocks as before kinds existed
        stateful = kinds is not None and kinds.stateful
        self.blocks = BlockSpec(block_size or tiers.block_size, kinds)
        self.tiers = tiers
        self.fingerprint = fingerprint
        self.model_id = model_id
        self.costs = RestoreModel(model_id, attention, stateful=kinds is not None)
        self.cost_file: CostFile | None = None  # the measurements outlive the process beside the SSD's blocks
        if tiers.ssd is not None:
            device = "gpu" if mx.default_device().type == mx.gpu else "cpu"
            self.cost_file = CostFile(tiers.ssd.folder / "costs" / f"{fingerprint}-{device}.json")
            self.cost_file.load(self.costs)
        size = self.blocks.block_size
        tails = TailIndex()  # parent key -> children stored by this process, with their tokens
        self.planner = Planner(
            tiers, fingerprint, size, kv_only=stateful, whole_tails=stateful, tails=tails,
            others=lambda: tiers.fingerprints.others(model_id, fingerprint),
        )  # fmt: skip
        self.write_back = WriteBack(tiers, fingerprint)
        self.loader = Loader(
            tiers, fingerprint, size, num_layers, kinds, self.costs, save_costs=self.save_costs,
            after_puts=self.write_back.hand_over_evicted,
        )  # fmt: skip
        self.saver = Saver(tiers, BlockCutter(fingerprint, num_layers, size, kinds), self.costs, tails, self.write_back)
        self.idle_probe = IdleProbe(tiers, fingerprint, size, self.costs, self.loader.reads, self.save_costs)
        if tiers.ssd is not None:
            tiers.follow(fingerprint, self.write_back.left_device)
        tiers.own(fingerprint)  # its engine copies its blocks device memory lets go to RAM
        tiers.fingerprints.add(model_id, fingerprint, size)

    # ----- restore ---------------------------------------------------------------------
    def match(
        self, tokens: list[int], grid: int = 0, *, resumed: bool = False, image_keys: ExtraKeys | None = None
    ) -> RestorePlan:
        return self.planner.match(tokens, self.costs.measured(self.blocks.block_size), grid, resumed, image_keys)

    def load(self, plan: RestorePlan, on_ready: Callable[[], None] = lambda: None) -> Loading:
        return self.loader.load(plan, on_ready)

    def advance(self, loading: Loading, move: bool, alone: bool = False) -> bool:
        return self.loader.advance(loading, move, alone)

    def cache_for(self, loading: Loading, fit: Fit | None = None) -> tuple[list[Any] | None, int]:
        cache, cached = self.loader.cache_for(loading)
        if fit is not None:
            cache, cached = fit(cache, cached)
        loading.report = why.explain(loading.plan, why.outcome(loading), cached)
        if loading.plan.counted:
            self.tiers.counters.record(loading.plan.prompt_tokens, cached)
        return cache, cached

    # ----- store -----------------------------------------------------------------------
    def store(
        self,
        tokens: list[int],
        cache: list[Any],
        *,
        final: bool,
        start: int = 0,
        boundary_states: dict[int, Any] | None = None,
        image_keys: ExtraKeys | None = None,
    ) -> int:
        return self.saver.store(
            tokens, cache, final=final, start=start, boundary_states=boundary_states, image_keys=image_keys
        )

    # ----- background work and memory ----------------------------------------------------
    def tick(self, idle: bool, *, quiet: bool = True) -> bool:
        """Write-back; then, idle and `quiet` with nothing left to move, the SSD's idle timing and the
        save a throttled one left behind. True while more waits."""
        more = self.write_back.step(idle)
        if idle and quiet and not more:
            self.idle_probe.step()
            if self.cost_file is not None and self.cost_file.unsaved:
                self.save_costs(True)
        return more

    def hold_writes(self, on: bool) -> None:
        if self.tiers.ssd is not None:
            self.tiers.ssd.hold_writes(self, on)

    def yield_memory(self, nbytes: int) -> int:
        """Free `nbytes` of device memory: this model's blocks waiting for their RAM copy are copied now, then
        the hot tier's least recently used blocks leave (to RAM or the SSD, as any eviction); the bytes freed."""
        freed = self.tiers.demote(self.fingerprint, limit=nbytes, due=True)[1] if self.tiers.demote_bound else 0
        if freed < nbytes:
            shed = self.tiers.device.shed(nbytes - freed)
            if shed and self.tiers.demote_bound:
                self.tiers.demote(self.fingerprint, limit=shed, due=True)
            freed += shed
        if freed:
            log.info("hot tier yielded %d bytes of device memory to running sequences", freed)
        return freed

    def hot_bytes(self) -> int:
        return self.tiers.device.held_bytes

    def observe_prefill(self, tokens: int, depth: int, seconds: float) -> None:
        self.costs.prefill.observe(tokens, depth, seconds)
        self.save_costs(False)

    def save_costs(self, force: bool, wait: bool = False) -> None:
        """Save the measurements (`CostFile.save`) where there is an SSD to keep them beside."""
        if self.cost_file is not None:
            self.cost_file.save(self.costs, force=force, wait=wait)

    def close(self, timeout: float) -> None:
        """At engine shutdown: copy to RAM this model's let-go blocks, hand the SSD writer what still waits
        (for up to `timeout` s), and stop following the tiers' evictions."""
        self.tiers.disown(self.fingerprint)
        self.save_costs(True, wait=True)  # the newest measurements, whatever was saved before
        left = self.write_back.drain(timeout)
        if left:
            log.warning("%d prefix-cache blocks of %s were not written to the SSD", left, self.model_id)
        self.tiers.unfollow(self.fingerprint, self.write_back.left_device)


def make_prefix_cache(
    tiers: Tiers, loaded: Any, *, captures_states: bool = False, stateful_block_size: int = 0
) -> PrefixCacheInterface:
    """The factory the engine pool calls on the engine thread after a model loads; a model with stateful
    layers (windows, recurrent arrays) is cached only for an engine that `captures_states` (chunks end on
    `capture_points`, `snapshot`s go to `store`), in blocks of `stateful_block_size` (0: the tiers')."""
    kinds, reason = model_kinds(loaded.model)
    if kinds is not None and kinds.stateful and not captures_states:
        names = sorted({type(c).__name__ for c in flatten(make_prompt_cache(loaded.model))})
        kinds, reason = None, f"its cache layers are {', '.join(names)} (this engine captures no layer states)"
    if kinds is None:
        log.warning("model %s is served without the prefix cache: %s", loaded.info.id, reason)
        return NoCache()
    block_size = (stateful_block_size if kinds.stateful else 0) or tiers.block_size
    fingerprint = model_fingerprint(
        loaded.info.id, weights_digest(loaded.info.path), loaded.compute_dtype, kinds.kv_format(), block_size
    )
    try:
        attention = attention_ratio(loaded.model)
    except (AttributeError, TypeError, ValueError, KeyError):  # a prior for an estimate: never worth failing a load over
        log.warning("model %s: attention's share of the prefill cost not read from its shapes", loaded.info.id)
        attention = None
    return PrefixCache(tiers, fingerprint, len(kinds.leaves), loaded.info.id, attention=attention, kinds=kinds, block_size=block_size)
