"""The saver: stores a sequence's blocks not cached yet (full ones and its unfinished tail) from what
the engine hands it as final, into device memory and on to the SSD writer (`WriteBack`); a stateful
model's block only with its layers' state at its end (docs/design/cache-kinds.md). Engine thread."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from omlx.cache.block import layer_states
from omlx.cache.block.hashing import ExtraKeys, block_keys, chain_key, relative
from omlx.cache.block.kinds import flatten
from omlx.cache.plan.restore_model import RestoreModel
from omlx.cache.plan.tail_index import TailIndex
from omlx.cache.saver import write_back
from omlx.cache.saver.blocks import BlockCutter, Spec, cache_length, kv_bytes_per_block
from omlx.cache.saver.write_back import WriteBack
from omlx.cache.tiers.residency import Residency
from omlx.cache.tiers.tiers import Tiers


class Saver:
    """One model's stores into `tiers`: blocks made by `cutter`, remembered by their tokens in `tails`,
    handed on by `write_back`; their sizes learnt into `costs`."""

    def __init__(
        self, tiers: Tiers, cutter: BlockCutter, costs: RestoreModel, tails: TailIndex, write_back: WriteBack
    ) -> None:
        self.tiers = tiers
        self.cutter = cutter
        self.costs = costs
        self.tails = tails
        self.write_back = write_back

    @property
    def block_size(self) -> int:
        return self.cutter.block_size

    def store(
        self, tokens: list[int], cache: list[Any], *, final: bool, start: int = 0,
        boundary_states: dict[int, Any] | None = None, image_keys: ExtraKeys | None = None,
    ) -> int:
        """Store every full block not cached yet and the unfinished tail as a partial block, from token `start`
        on; 0 when done, else where the blocks left for a later call begin (`tokens` past what `cache` holds
        are cut, but a cache of recurrent layers alone cannot tell: cache-kinds.md)."""
        held = cache_length(cache, len(tokens))
        tokens = tokens[: min(len(tokens), held)]
        keys = block_keys(self.cutter.fingerprint, tokens, self.block_size, image_keys)
        generation = self.tiers.directory.generation  # what is stored before a clear is not written back
        # a block the hot tier cannot hold would be made only to go straight to RAM: when RAM holds it, none is made
        ram_is_enough = self.only_ram_keeps_blocks()
        known = self._known(ram_is_enough)
        if start and keys and not (known(keys[0]) or self._kv_only_copy(keys[0])):  # cleared, or let go meanwhile
            return 0
        chain, new = self._chain_and_new(tokens, keys, start, known, image_keys)
        rest = 0
        if final and ram_is_enough:  # each piece a bounded copy to RAM
            per_call = max(1, write_back.WRITE_BACK_CHUNK // max(1, self.costs.restore_bytes(self.block_size) or kv_bytes_per_block(cache, self.block_size)))
            if len(new) > per_call:
                rest, new = new[per_call][2], new[:per_call]
        states = None
        if self.cutter.kinds is not None:  # a block of stateful layers only with their state at its end
            new, states = self._states_at_ends(new, cache, held, boundary_states or {})
        if not new:
            self.tiers.touch_chain(chain)
            return 0
        self._put(tokens, chain, new, self.cutter.cut(cache, new, states), generation, image_keys)
        self.tiers.touch_chain(chain)
        return rest

    def _put(
        self, tokens: list[int], chain: list[str], new: list[Spec], blocks: list[Any], generation: int,
        image_keys: ExtraKeys | None = None,
    ) -> None:
        """New blocks into device memory, deepest first, each pushing out none of its ancestors (a chain longer
        than the hot tier keeps its first blocks, as a prefix tree evicts leaves), then waiting for the writer."""
        for key, parent, a, b in new:
            self.tails.remember(parent, key, tokens[a:b], relative(image_keys, a, b))
        mx.eval([t for b in blocks for t in b.tensors.values()])
        if self.tiers.ssd is not None:
            self.write_back.await_write(blocks, generation)
        self.tiers.moved_in(sum(block.nbytes for block in blocks))
        for (_, _, a, _), block in reversed(list(zip(new, blocks, strict=True))):
            self.tiers.device.put(block, keep=frozenset(chain[: a // self.block_size]))
        self.costs.learn_size(blocks[0].nbytes, blocks[0].token_count, layer_states.state_nbytes(blocks[0].tensors))
        self.write_back.hand_over_evicted()

    def _known(self, ram_is_enough: bool) -> Callable[[str], bool]:
        """Whether a key has a whole copy somewhere already (a KV-only one in device memory does not count)."""
        tiers, fingerprint = self.tiers, self.cutter.fingerprint

        def known(key: str) -> bool:
            return (
                tiers.on_device(key, whole=True)
                or (ram_is_enough and tiers.ram is not None and tiers.ram.contains(key))
                or (tiers.ssd is not None and (tiers.ssd.writing(key) or tiers.ssd.contains(key, fingerprint)))
            )

        return known

    def _chain_and_new(
        self, tokens: list[int], keys: list[str], start: int, known: Callable[[str], bool],
        image_keys: ExtraKeys | None = None,
    ) -> tuple[list[str], list[Spec]]:
        """The chain of `tokens`' keys (full blocks, then the partial tail's), and the (key, parent, start,
        end) of each block from token `start` on not `known` yet."""
        size = self.block_size
        new: list[Spec] = []
        for i, key in enumerate(keys):
            if i * size >= start and not known(key):
                new.append((key, keys[i - 1] if i else None, i * size, (i + 1) * size))
        chain = list(keys)
        tail = len(keys) * size
        if tail < len(tokens):
            parent = keys[-1] if keys else None
            key = chain_key(self.cutter.fingerprint, parent, tokens[tail:], relative(image_keys, tail))
            chain.append(key)
            if not known(key):
                new.append((key, parent, tail, len(tokens)))
        return chain, new

    def _states_at_ends(
        self, new: list[Spec], cache: list[Any], length: int, given: dict[int, Any]
    ) -> tuple[list[Spec], dict[int, Any]]:
        """`new` up to the first block whose end has no complete state (`given`, or `cache` itself at its
        `length` when its layers tell it), a chain with a hole serving nothing after it; a block device
        memory holds KV-only is left out there (the chain goes on through its KV), stored whole with one."""
        kinds = self.cutter.kinds
        states: dict[int, Any] = {}
        kept: list[Spec] = []
        tells = any(hasattr(leaf, "offset") for leaf in flatten(cache))  # else `length` is the caller's word
        for spec in new:
            state = given.get(spec[3])
            if state is None and tells and spec[3] == length:
                state = layer_states.snapshot(kinds, cache)
            if layer_states.complete(kinds, state):
                kept.append(spec)
                states[spec[3]] = state
            elif not self._kv_only_copy(spec[0]):
                break
        return kept, states

    def _kv_only_copy(self, key: str) -> bool:
        """Whether device memory holds `key` as a KV-only copy (without its state)."""
        return bool(self.tiers.residency(key) & Residency.KV_ONLY)

    def only_ram_keeps_blocks(self) -> bool:
        """The hot tier cannot hold one block (it is off, or smaller), so every stored block goes to RAM
        at once, copied on the engine thread."""
        block_bytes = self.costs.restore_bytes(self.block_size)
        return self.tiers.ram is not None and block_bytes > 0 and not self.tiers.device.can_hold(block_bytes)

