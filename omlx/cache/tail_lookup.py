"""The unfinished tail of a lookup: the partial block after its full blocks, found by exact key
or token by token, and how much of it is usable (all of it, or none, for a model with stateful
layers: docs/design/cache-kinds.md). Mixed into `PrefixCache`."""

from __future__ import annotations

from omlx.cache.block import CacheBlock
from omlx.cache.block_hash import tail_keys

# A partial block alone is restored only from this many tokens: a few shared tokens (a chat
# template's header) save no measurable prefill, yet make the request's prompt length differ
# from its prefill batch-mates', which sends the batch through mlx-lm's padded path.
MIN_TAIL_ONLY_TOKENS = 32


class TailLookup:
    """`PrefixCache`'s search for the partial block after a lookup's full blocks."""

    def _with_tail(
        self, parts: list[tuple[CacheBlock, int]], keys: list[str], tokens: list[int], skipped: bool
    ) -> list[tuple[CacheBlock, int]]:
        """`parts` (full blocks) and, where one is found and usable, the partial block after
        them (`_find_tail`), with how many of its tokens to use."""
        limit, blocks = len(tokens) - 1, len(parts)
        n = blocks * self.B
        # after a skipped restore the tail, too, only comes from device memory: the token-level
        # search would otherwise fetch from the tier just judged slower than recomputing
        tail, usable = None, 0
        # no tail either when it could not reach the engine's prefill grid (a tail is shorter
        # than a block): the engine would drop it after its fetch, stalling every stream
        reach = self.grid - n % self.grid if self.grid else 1
        whole = self.kinds is not None and self.kinds.stateful  # a state holds only at its block's end
        if limit - n >= reach and reach < self.B:  # else none is fetched, from any tier
            rest = tokens[n:limit] if whole else tokens[n:]
            parent = keys[blocks - 1] if blocks else None
            tail, usable = self._find_tail(parent, rest, skipped, frozenset(keys), by_tokens=not whole)
        if tail is not None:
            # an exact repeat finds the whole prompt's tail: use all but the last token
            use = min(usable, limit - n)
            if self.grid:
                use -= (n + use) % self.grid
            if whole and use != tail.token_count:
                use = 0
            if use > 0 and (blocks or use >= MIN_TAIL_ONLY_TOKENS):
                parts.append((tail, use))
        return parts

    def _find_tail(
        self,
        parent: str | None,
        rest: list[int],
        hot_only: bool = False,
        chain: frozenset[str] = frozenset(),
        by_tokens: bool = True,
    ) -> tuple[CacheBlock | None, int]:
        """The stored block after `parent` sharing the longest token prefix with `rest`, and how
        many tokens of it are usable: exact partial blocks by key (also after a restart), then
        (`by_tokens`) this process's blocks token by token (`TailIndex`)."""
        best: tuple[CacheBlock | None, int] = (None, 0)
        keys = tail_keys(self.fp, parent, rest[: self.B - 1])
        held = self.tiers.held(keys)  # asked once, not each tier for each of up to B - 1 lengths
        for length in range(len(keys), 0, -1):
            if held is not None and keys[length - 1] not in held:
                continue
            block = self._get(keys[length - 1], hot_only, chain)
            if block is not None:
                best = (block, length)
                break
        if not by_tokens:
            return best
        for shared, key in self.tails.candidates(parent, rest):
            if shared <= best[1]:
                break
            block = self._get(key, hot_only, chain)
            if block is not None:
                return block, shared
        return best
