"""`look`: what the tiers know where a plan's restore ends (`MissFacts`), read under the tiers' lock
like `match` (no MLX, no file read once the SSD is indexed), for `why.explain`. A few key lookups and
at most `PER_MODEL` block hashes: cheap enough for every request (docs/design/cache-explain.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from omlx.cache.block.hashing import ExtraKeys, block_keys, relative
from omlx.cache.plan.restore_plan import MissFacts, Tier
from omlx.cache.plan.tail_index import TailIndex

# a model's other builds: (fingerprint, block size), newest first (`FingerprintBook.others`)
OtherBuilds = Callable[[], list[tuple[str, int]]]


class FactsView(Protocol):
    """What `look` reads of the tiers."""

    def tier_of(self, key: str, fingerprint: str, device_only: bool = False) -> Tier | None: ...

    def evicted(self, key: str) -> bool: ...


def look(
    view: FactsView,
    tails: TailIndex,
    others: OtherBuilds,
    fingerprint: str,
    tokens: list[int],
    keys: Sequence[str],
    blocks: int,
    block_size: int,
    tail_tokens: int,
    image_keys: ExtraKeys | None = None,
) -> MissFacts:
    """The facts where `blocks` full blocks of the prompt `tokens` (chain `keys`) and `tail_tokens` of a tail
    are restored, its blocks keyed by `fingerprint`; none to read when all but the last token are."""
    n = blocks * block_size
    if n + tail_tokens >= len(tokens) - 1:
        return MissFacts()
    parent = keys[blocks - 1] if blocks else None
    best = tails.best(parent, tokens[n:], relative(image_keys, n))
    shared, held, length = 0, False, 0
    if best is not None:
        shared, key, length = best
        # whether it is held matters only where it shares more than the restore used (`why.explain`):
        # a prompt that shares nothing with the cached one asks no tier
        held = shared > tail_tokens and view.tier_of(key, fingerprint) is not None
    next_evicted = blocks < len(keys) and view.evicted(keys[blocks])
    other = False
    if not blocks and not tail_tokens:
        for fp, size in others():
            if len(tokens) > size and view.tier_of(block_keys(fp, tokens[:size], size, image_keys)[0], fp) is not None:
                other = True
                break
    return MissFacts(shared, held, length, next_evicted, other)
