"""One model's prefix cache (`PrefixCacheInterface`): find, restore and store its blocks, full
ones and each sequence's unfinished tail, over the tiers every model shares; its parts are
`tier_restore`, `read_ahead`, `write_back`, `idle_probe`, `tail_lookup`, `stateful_layers` ..."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from omlx.cache import layer_states, write_back
from omlx.cache.block import CacheBlock
from omlx.cache.block_hash import (
    block_keys,
    chain_key,
    model_fingerprint,
    weights_digest,
)
from omlx.cache.cache_kinds import CacheKinds, flatten, model_kinds
from omlx.cache.cost_file import CostFile
from omlx.cache.idle_probe import IdleProbe
from omlx.cache.interface import NoCache, PrefixCacheInterface
from omlx.cache.kv_layout import (
    KV_STACK,
    join_blocks,
    layer_tensors,
    stack_group_bytes,
    stackable,
)
from omlx.cache.model_shapes import attention_ratio
from omlx.cache.read_ahead import ReadAhead
from omlx.cache.restore_model import RestoreModel, Throughput
from omlx.cache.stateful_layers import StatefulLayers
from omlx.cache.store import CacheStore
from omlx.cache.tail_index import TailIndex
from omlx.cache.tail_lookup import MIN_TAIL_ONLY_TOKENS, TailLookup
from omlx.cache.tier_restore import TierRestore
from omlx.cache.write_back import CopyPacer, WriteBack

log = logging.getLogger("omlx.cache")

__all__ = ["MIN_TAIL_ONLY_TOKENS", "PrefixCache", "make_prefix_cache"]


class PrefixCache(ReadAhead, TierRestore, WriteBack, IdleProbe, TailLookup, StatefulLayers):
    """One model's prefix cache over the shared tiers (`PrefixCacheInterface`)."""

    grid = 0  # the engine's prefill grid (`PrefixCacheInterface.grid`)

    def __init__(
        self,
        store: CacheStore,
        fingerprint: str,
        num_layers: int,
        model_id: str,
        attention: float | None = None,
        kinds: CacheKinds | None = None,
        block_size: int = 0,
    ):
        """`block_size`: tokens per block (0: the store's; a model with stateful layers may have its own)."""
        self.tiers = store
        # per-leaf cache kinds; None or plain KV: blocks as before kinds existed (docs/design/cache-kinds.md)
        self.kinds = kinds if kinds is not None and not kinds.plain_kv else None
        # with layer states: a restore reads its blocks' KV and its last block's state apart
        self.by_part = self.kinds is not None and self.kinds.stateful
        self.fp = fingerprint
        self.B = self.block_size = block_size or store.block_size
        self.num_layers = num_layers
        self.model_id = model_id
        # restore or recompute: the prefill cost on this device and each slow tier's rate
        self.costs = RestoreModel(model_id, attention)
        self.costs.block_size = self.B if self.kinds is not None else 0  # a state per block restored
        self.prefill = self.costs.prefill
        self.ssd_rate = self.costs.ssd_rate
        self.warm_rate = self.costs.warm_rate
        self.warm_copy_rate = self.costs.warm_copy_rate
        # stored blocks not yet handed to the SSD writer wait in the store's directory
        # (`write_back`); an unwritten block the hot tier let go on another model's thread,
        # with no RAM copy, is handed over by this engine's thread (`_left_device`)
        self._owner = threading.get_ident()  # made on the engine thread (`make_prefix_cache`)
        # blocks a finished prefetch read for the next lookup are staged in the directory; the
        # seconds their reads took per byte, and the read seconds of those `lookup` used
        # (charged to the SSD's restore rate)
        self._staged_s_per_byte = 0.0
        self._staged_read_s = 0.0
        self._cut_ahead = False  # the staged read-ahead was cut short: its lookup reads no more from the SSD
        # the block keys `prefetch` hashed, for the `lookup` of the same request (both are
        # asked at its admission, and a long prompt's hashing is not free)
        self._keys_ahead: tuple[list[int], int, list[str]] | None = None
        self._idle_probe: list[Any] | None = None  # `probe_idle`'s reads in flight (futures)
        self._idle_probe_none_at = -1  # the SSD's block count when it held none of this model's
        # stored blocks wait for an idle engine; copies out while busy are paced (write-back.md)
        self.pacer = CopyPacer()
        if store.ssd is not None:
            store.follow(fingerprint, self._left_device)
        if store.demote_bound:
            store.own(fingerprint)  # `write_back` copies its evicted blocks to RAM
        # parent key ("" = root) → children stored by this process, with their tokens
        self.tails = TailIndex()
        self.cost_file: CostFile | None = None  # the measurements outlive the process
        if store.ssd is not None:
            device = "gpu" if mx.default_device().type == mx.gpu else "cpu"
            self.cost_file = CostFile(store.ssd.directory / "costs" / f"{fingerprint}-{device}.json")
            self.cost_file.load(self.costs)

    @property
    def bytes_per_token(self) -> int:
        return self.costs.bytes_per_token

    @bytes_per_token.setter
    def bytes_per_token(self, value: int) -> None:
        self.costs.bytes_per_token = value

    @property
    def block_bytes(self) -> int:
        """Bytes of one full block: its KV and, with stateful layers, their state (0: not known)."""
        return self.costs.restore_bytes(self.B)

    # ----- lookup / restore ----------------------------------------------------------
    def lookup(self, tokens: list[int]) -> tuple[list[Any] | None, int]:
        try:
            return self._lookup(tokens)
        finally:  # one request's read-ahead; what it did not use goes
            self.tiers.directory.unstage_all(self.fp)
            self._staged_s_per_byte = self._staged_read_s = 0.0
            self._cut_ahead = False

    def _prompt_keys(self, tokens: list[int], keep: bool = False) -> list[str]:
        """`tokens`' block keys, hashed once per admission: `prefetch` keeps them (`keep`) for
        the `lookup` that follows, which takes them. Only the same list object of the same
        length gets them: a request's prompt is never changed in place."""
        ahead, self._keys_ahead = self._keys_ahead, None
        if ahead is not None and ahead[0] is tokens and ahead[1] == len(tokens):
            return ahead[2]
        keys = block_keys(self.fp, tokens, self.B)
        if keep:
            self._keys_ahead = (tokens, len(tokens), keys)
        return keys

    def _lookup(self, tokens: list[int]) -> tuple[list[Any] | None, int]:
        limit = len(tokens) - 1  # at least one token must be computed to get logits
        keys = self._prompt_keys(tokens)
        chain = frozenset(keys)  # what a lookup brings into the hot tier pushes out none of these
        hot, warm, ssd = self.tiers.hot, self.tiers.warm, self.tiers.ssd
        blocks = self._device_run(keys, limit, chain)
        held = sum(b.nbytes for b in blocks) if self.by_part else 0  # a hot chain's KV (`_charge_restores`)
        restored: list[tuple[Throughput, int, float]] = []  # (tier rate, bytes, seconds so far)
        skipped = False  # a slower tier held more, and recomputing it was judged faster
        if warm is not None:
            # moved when the hot tier can keep the whole run, else copied (RAM keeps it): each
            # way has its own rate (docs/design/restore-or-recompute.md); a stateful model's KV copied
            run = self._run_in(keys, len(blocks), limit, warm.contains)
            move = not self.by_part and hot.can_hold(sum(held.nbytes for held in map(warm.peek, run) if held is not None))
            got, skipped = self._restore_run(
                run, len(blocks) * self.B, lambda part: self._from_warm_run(part, move),
                self.warm_rate if move else self.warm_copy_rate, restored, chain,
            )  # fmt: skip
            blocks += got
        if ssd is not None and not skipped and self._cut_ahead:  # what was read, then recompute
            run = self._run_in(keys, len(blocks), limit, self.tiers.directory.is_staged)
            got, seconds = self._fetch(run, self._from_ssd, chain)
            if got:
                restored.append((self.ssd_rate, sum(b.nbytes for b in got), seconds))
            blocks, skipped = blocks + got, True
        elif ssd is not None and not skipped:
            run = self._run_in(keys, len(blocks), limit, lambda k: self.tiers.directory.is_staged(k) or ssd.contains(k, self.fp))
            got, skipped = self._restore_run(run, len(blocks) * self.B, self._from_ssd, self.ssd_rate, restored, chain)
            blocks += got
        if self._staged_read_s:  # the reads ahead of what was used count into the SSD's restore time
            restored[:] = [
                (rate, nbytes, seconds + (self._staged_read_s if rate is self.ssd_rate else 0.0))
                for rate, nbytes, seconds in restored
            ]
        parts = self._with_tail([(b, self.B) for b in blocks], keys, tokens, skipped)
        if self.by_part:  # a run read KV-only: its last block's state, alone
            parts = self._with_last_state(parts, restored, chain)
        if not parts:
            return None, 0
        self._refresh_chain([block.key for block, _ in parts])
        caches = join_blocks(parts, self.num_layers) if self.kinds is None else layer_states.restore(self.kinds, parts)
        if restored:
            self._charge_restores(caches, restored, held)
        return caches, sum(used for _, used in parts)

    def _device_run(self, keys: list[str], limit: int, chain: frozenset[str]) -> list[CacheBlock]:
        """The blocks of `keys` from the root that device memory holds, within `limit` tokens (one
        taken back into the hot tier pushes out none of `chain`)."""
        blocks: list[CacheBlock] = []
        for i, key in enumerate(keys):
            if (i + 1) * self.B > limit:
                break
            block = self.tiers.hot.get(key)  # counts the hot tier's hits and misses, as `_get` does not
            if block is None:  # the hot tier let it go: still in device memory, waiting for a copy?
                block = self._on_device(key)
                if block is None:
                    break
                self.tiers.hot.put(block, keep=chain)
            blocks.append(block)
        return blocks

    def _charge_restores(self, caches: list[Any], restored: list[tuple[Throughput, int, float]], held: int = 0) -> None:
        """The model's cache built from restored blocks is where their cost ends (on a CUDA GPU the first
        device use of host-written memory migrates it): that time goes into each tier's restore time,
        shared by bytes, not into the prefill; `held` bytes from device memory take their share unbilled."""
        tic = time.perf_counter()
        mx.eval([c.state for c in caches])
        extra = time.perf_counter() - tic
        total = max(1, held + sum(nbytes for _, nbytes, _ in restored))  # a KV-only run of recurrent layers alone reads none
        for rate, nbytes, seconds in restored:
            rate.observe(nbytes, seconds + extra * nbytes / total)
        self._save_costs(force=True)

    def _run_in(self, keys: list[str], start: int, limit: int, contains: Callable[[str], bool]) -> list[str]:
        """The keys from `keys[start]` on that `contains` holds, as far as full blocks within
        `limit` tokens go (what a lookup would restore from that tier)."""
        run = []
        for i in range(start, len(keys)):
            if (i + 1) * self.B > limit or not contains(keys[i]):
                break
            run.append(keys[i])
        return run

    def _get(self, key: str, hot_only: bool = False, chain: frozenset[str] = frozenset()) -> CacheBlock | None:
        """A block from device memory, else (unless `hot_only`) RAM or the SSD, promoted to
        hot without pushing out `chain`'s blocks; None if in none."""
        hot, warm, ssd = self.tiers.hot, self.tiers.warm, self.tiers.ssd
        if hot.contains(key):
            block = hot.get(key)
            if block is not None and not block.partial:  # a KV-only copy: the whole block from below
                return block
        block = self._on_device(key)  # device memory still, though the hot tier let it go
        if block is not None:
            hot.put(block, keep=chain)
            return block
        if hot_only:
            return None
        block = None
        if warm is not None and warm.contains(key):
            block = self._from_warm(key, move=hot.can_hold(self.block_bytes))
        if block is None and ssd is not None and ssd.contains(key, self.fp):
            block = ssd.get(key, self.fp)
        if block is not None:
            # evaluated here, on this engine's thread: in the hot tier another model's thread
            # may be the next to touch it (`CacheStore._left_device`)
            mx.eval(list(block.tensors.values()))
            self._learn_size(block)  # a whole block (a stateful model's tail may be the only one a restore reads)
            self.tiers.moved_in(block.nbytes)
            hot.put(block, keep=chain)
        return block

    # ----- store ---------------------------------------------------------------------
    def store(
        self,
        tokens: list[int],
        cache: list[Any],
        *,
        final: bool,
        start: int = 0,
        boundary_states: dict[int, Any] | None = None,
    ) -> int:
        """Store every full block not cached yet and the unfinished tail as a partial block, from
        token `start` on; 0 when done, else where the blocks left for a later call begin (`tokens` past
        what `cache` holds are cut, but a cache of recurrent layers alone cannot tell: cache-kinds.md)."""
        held = self._cache_length(cache, len(tokens))
        n_tokens = min(len(tokens), held)
        tokens = tokens[:n_tokens]
        keys = block_keys(self.fp, tokens, self.B)
        hot, warm, ssd = self.tiers.hot, self.tiers.warm, self.tiers.ssd
        generation = self.tiers.generation  # what is stored before a clear() is not written back
        # A block the hot tier cannot hold would be made (a device copy per layer) only to go
        # straight back to RAM: when RAM holds it, recomputing its tokens needs no new copy.
        ram_is_enough = self._only_ram_keeps_blocks()

        def known(key: str) -> bool:  # a whole copy somewhere (a KV-only hot copy: `_states_at_ends`)
            return (
                self._in_device_memory(key, whole=True)
                or (ram_is_enough and warm.contains(key))
                or (ssd is not None and (ssd.writing(key) or ssd.contains(key, self.fp)))
            )

        if start and keys and not (known(keys[0]) or self._kv_only(keys[0])):  # cleared, or let go meanwhile: the rest would hang off nothing
            return 0
        chain, new = self._chain_and_new(tokens, keys, start, known)
        rest = 0
        if final and ram_is_enough:  # each piece a bounded copy to RAM
            per_call = max(1, write_back.WRITE_BACK_CHUNK // max(1, self._bytes_per_block(cache)))
            if len(new) > per_call:
                rest, new = new[per_call][2], new[:per_call]
        states = None
        if self.kinds is not None:  # a block of stateful layers only with their state at its end
            new, states = self._states_at_ends(new, cache, held, boundary_states or {})
        if not new:
            self._refresh_chain(chain)
            return 0
        blocks = self._make_blocks(cache, new, states)
        for key, parent, a, b in new:
            self.tails.remember(parent, key, tokens[a:b])
        mx.eval([t for b in blocks for t in b.tensors.values()])
        if ssd is not None:
            self._await_write_back(blocks, generation)
        # after: one the hot tier cannot keep goes to the SSD writer at once. Deepest first, each
        # pushing out none of its ancestors, as a prefix tree evicts leaves: a chain longer than
        # the hot tier keeps its first blocks (a chain without its root serves no lookup)
        self.tiers.moved_in(sum(block.nbytes for block in blocks))
        for (_, _, a, _), block in reversed(list(zip(new, blocks, strict=True))):
            hot.put(block, keep=frozenset(chain[: a // self.B]))
        self._refresh_chain(chain)
        if blocks:
            self._learn_size(blocks[0])
        return rest

    def _bytes_per_block(self, cache: list[Any]) -> int:
        """A full block's bytes: measured, or before any block was, the KV of `cache`'s layers over its tokens."""
        return self.block_bytes or self.B * sum(
            leaf.keys.nbytes // max(1, leaf.keys.shape[2]) * 2 for leaf in flatten(cache) if getattr(leaf, "keys", None) is not None
        )  # fmt: skip

    def _chain_and_new(
        self, tokens: list[int], keys: list[str], start: int, known: Callable[[str], bool]
    ) -> tuple[list[str], list[tuple[str, str | None, int, int]]]:
        """The chain of `tokens`' keys (full blocks, then the partial tail's), and the
        (key, parent, start, end) of each block from token `start` on not `known` yet."""
        new: list[tuple[str, str | None, int, int]] = []
        for i, key in enumerate(keys):
            if i * self.B >= start and not known(key):
                new.append((key, keys[i - 1] if i else None, i * self.B, (i + 1) * self.B))
        chain = list(keys)
        tail = len(keys) * self.B
        if tail < len(tokens):
            parent = keys[-1] if keys else None
            key = chain_key(self.fp, parent, tokens[tail:])
            chain.append(key)
            if not known(key):
                new.append((key, parent, tail, len(tokens)))
        return chain, new

    def _refresh_chain(self, keys: list[str]) -> None:
        """Mark one chain's blocks (root first) used in every tier holding them, deepest first, so
        its root ends the most recently used and eviction takes chains from their ends."""
        # Root first, a chain would lose its first blocks first, and a chain without its first
        # block serves no lookup while its other blocks still take room; deepest first, eviction
        # takes chains from their ends, as a prefix tree evicts leaves. The lower tiers too: a
        # prefix served from device memory for hours must not be what the SSD's budget drops.
        order = keys[::-1]
        for tier in (self.tiers.hot, self.tiers.warm, self.tiers.ssd):
            if tier is not None:
                tier.touch_many(order)

    def _make_blocks(
        self, cache: list[Any], specs: list[tuple[str, str | None, int, int]], states: dict[int, Any] | None = None
    ) -> list[CacheBlock]:
        """Blocks of `cache` for `(key, parent, start, end)` token ranges (with stateful layers, their
        `states` at each end); on a GPU, stacked blocks are cut from one stack of each run of adjacent
        ranges (`STACK_GROUP_BYTES` at a time), far fewer launches (docs/design/ram-moves.md)."""
        if not specs:
            return []
        if states is not None:
            tensors = layer_states.block_tensors
            return [self._block(k, p, b - a, tensors(self.kinds, cache, a, b, states[b])) for k, p, a, b in specs]
        if not stackable(cache):
            return [self._block(key, parent, b - a, layer_tensors(cache, a, b)) for key, parent, a, b in specs]
        per_token = 2 * len(cache) * cache[0].keys.shape[1] * cache[0].keys.shape[3] * cache[0].keys.itemsize
        most = max(1, stack_group_bytes() // max(1, per_token * self.B))
        blocks: list[CacheBlock] = []
        group: list[tuple[str, str | None, int, int]] = []
        for spec in [*specs, None]:
            if group and (spec is None or spec[2] != group[-1][3] or len(group) == most):
                lo, hi = group[0][2], group[-1][3]
                stack = mx.concatenate([t[:, :, lo:hi, :] for c in cache for t in (c.keys, c.values)])
                cut = len(group) > 1  # else the stack is the block
                blocks += [
                    self._block(key, parent, b - a, {KV_STACK: mx.contiguous(stack[:, :, a - lo : b - lo, :]) if cut else stack})
                    for key, parent, a, b in group
                ]  # fmt: skip
                group = []
            if spec is not None:
                group.append(spec)
        return blocks

    def _block(self, key: str, parent: str | None, token_count: int, tensors: dict[str, mx.array]) -> CacheBlock:
        return CacheBlock(
            key=key, parent=parent, fingerprint=self.fp, token_count=token_count,
            layer_types=["kv"] * self.num_layers if self.kinds is None else self.kinds.tags(), tensors=tensors,
        )  # fmt: skip

    def close(self, timeout: float) -> None:
        """At engine shutdown: copy to RAM this model's evicted blocks, hand the SSD writer what
        still waits (for up to `timeout` s), and stop following the store's evictions."""
        if self.tiers.demote_bound:
            self.tiers.disown(self.fp)
        self._save_costs(force=True, wait=True)  # the newest measurements, whatever was saved before
        deadline = time.monotonic() + timeout
        directory = self.tiers.directory
        while directory.unwritten(self.fp) and time.monotonic() < deadline:
            if not self.write_back(idle=True) and directory.unwritten(self.fp):
                time.sleep(0.01)  # the writer's queue is full: let it drain
        left = directory.drop_unwritten(self.fp)
        if left:
            log.warning("%d prefix-cache blocks of %s were not written to the SSD", left, self.model_id)
        self.tiers.unfollow(self.fp, self._left_device)

    # ----- bookkeeping ---------------------------------------------------------------
    def record(self, prompt_tokens: int, cached_tokens: int) -> None:
        c = self.tiers.counters
        with c.lock:
            c.requests += 1
            c.prompt_tokens += prompt_tokens
            c.hit_tokens += cached_tokens
            if cached_tokens:
                c.hits += 1
            else:
                c.misses += 1

    def hot_bytes(self) -> int:
        return self.tiers.hot.held_bytes

    def yield_memory(self, nbytes: int) -> int:
        """Free `nbytes` of device memory: this model's blocks waiting for their RAM copy are
        copied now, then the hot tier's least recently used blocks leave (to RAM or the SSD, as
        any eviction: copied now too); the bytes freed."""
        freed = 0
        if self.tiers.demote_bound:
            freed = self.tiers.demoted(self.fp, limit=nbytes, due=True)[1]
        if freed < nbytes:
            shed = self.tiers.hot.shed(nbytes - freed)
            if shed and self.tiers.demote_bound:
                self.tiers.demote(self.fp, limit=shed, due=True)
            freed += shed
        if freed:
            log.info("hot tier yielded %d bytes of device memory to running sequences", freed)
        return freed

    def wants_prompt_blocks(self, prompt_tokens: int, cached_tokens: int) -> bool:
        """Store right after prefill only when at least a block's worth was computed, and not
        when only RAM would keep the blocks: the whole prompt's KV would be copied device ->
        host between its first and second token (docs/design/write-back.md)."""
        return prompt_tokens - cached_tokens >= self.B and not self._only_ram_keeps_blocks()

    def _only_ram_keeps_blocks(self) -> bool:
        """The hot tier cannot hold one block (it is off, or smaller), so every stored block
        goes to host RAM at once, copied on the engine thread."""
        warm, hot = self.tiers.warm, self.tiers.hot
        return warm is not None and self.block_bytes > 0 and not hot.can_hold(self.block_bytes)

    def observe_prefill(self, tokens: int, depth: int, seconds: float) -> None:
        self.prefill.observe(tokens, depth, seconds)
        self._save_costs()

    def prefill_seconds(self, tokens: int, depth: int) -> float | None:
        return self.prefill.seconds(tokens, depth)

    def _save_costs(self, force: bool = False, wait: bool = False) -> None:
        """Save the measurements (`CostFile.save`) when there is an SSD to keep them beside."""
        if self.cost_file is not None:
            self.cost_file.save(self.costs, force=force, wait=wait)


def make_prefix_cache(
    store: CacheStore, loaded: Any, *, captures_states: bool = False, stateful_block_size: int = 0
) -> PrefixCacheInterface:
    """The factory the engine pool calls on the engine thread after a model loads; a model with stateful
    layers (windows, recurrent arrays) is cached only for an engine that `captures_states` (chunks end on
    `capture_points`, `snapshot`s go to `store`), in blocks of `stateful_block_size` (0: the store's)."""
    kinds, reason = model_kinds(loaded.model)
    if kinds is not None and kinds.stateful and not captures_states:
        names = sorted({type(c).__name__ for c in flatten(make_prompt_cache(loaded.model))})
        kinds, reason = None, f"its cache layers are {', '.join(names)} (this engine captures no layer states)"
    if kinds is None:
        log.warning("model %s is served without the prefix cache: %s", loaded.info.id, reason)
        return NoCache()
    block_size = (stateful_block_size if kinds.stateful else 0) or store.block_size
    fp = model_fingerprint(
        loaded.info.id, weights_digest(loaded.info.path), loaded.compute_dtype, kinds.kv_format(), block_size
    )
    try:
        attention = attention_ratio(loaded.model)
    except (AttributeError, TypeError, ValueError, KeyError):  # a prior for an estimate: never worth failing a load over
        log.warning("model %s: attention's share of the prefill cost not read from its shapes", loaded.info.id)
        attention = None
    return PrefixCache(store, fp, len(kinds.leaves), loaded.info.id, attention=attention, kinds=kinds, block_size=block_size)
