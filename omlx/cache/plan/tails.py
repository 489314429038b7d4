"""The partial block after a plan's full blocks: stored tails by exact key (also after a restart),
then this process's by tokens (`TailIndex`), each with how many of its tokens the prompt uses (all or
none for a model with stateful layers: docs/design/cache-kinds.md). No MLX."""

from __future__ import annotations

from typing import Protocol

from omlx.cache.block.hashing import ExtraKeys, relative, tail_keys
from omlx.cache.plan.restore_plan import Tail, Tier
from omlx.cache.plan.tail_index import TailIndex

# A partial block alone is restored only from this many tokens: a few shared tokens (a chat
# template's header) save no measurable prefill, yet make the request's prompt length differ
# from its prefill batch-mates', which sends the batch through mlx-lm's padded path.
MIN_TAIL_ONLY_TOKENS = 32


class TailView(Protocol):
    """What the tail search reads of the tiers."""

    def held(self, keys: list[str]) -> set[str] | None: ...

    def tier_of(self, key: str, fingerprint: str, device_only: bool) -> Tier | None: ...


def find_tails(
    view: TailView,
    index: TailIndex,
    fingerprint: str,
    tokens: list[int],
    keys: list[str],
    block_size: int,
    grid: int,
    *,
    device_only: bool = False,
    whole: bool = False,
    image_keys: ExtraKeys | None = None,
) -> tuple[Tail, ...]:
    """The tails after the full blocks `keys` that the prompt `tokens` (with its `image_keys`) could use,
    best first; `device_only` after a run judged not to pay (a tail must not fetch what was just judged
    slower than recomputing)."""
    limit, n = len(tokens) - 1, len(keys) * block_size
    reach = grid - n % grid if grid else 1  # a tail that cannot reach the grid would be dropped: not fetched
    if limit - n < reach or reach >= block_size:
        return ()
    rest = tokens[n:limit] if whole else tokens[n:]
    parent = keys[-1] if keys else None
    found: list[tuple[int, int, str, Tier]] = []  # (tokens shared, exact first, key, tier)
    extras = relative(image_keys, n)
    exact = tail_keys(fingerprint, parent, rest[: block_size - 1], extras)
    held = view.held(exact)
    for length in range(len(exact), 0, -1):
        key = exact[length - 1]
        tier = None if held is not None and key not in held else view.tier_of(key, fingerprint, device_only)
        if tier is not None:
            found.append((length, 1, key, tier))
            break
    if not whole:
        best = found[0][0] if found else 0
        for shared, key in index.candidates(parent, rest, extras):
            if shared <= best:
                break
            tier = view.tier_of(key, fingerprint, device_only)
            if tier is not None:
                found.append((shared, 0, key, tier))
    found.sort(key=lambda f: (-f[0], -f[1]))
    return tuple(
        Tail(key, use, tier)
        for shared, _, key, tier in found
        if (use := usable(shared, n, limit, grid, whole)) > 0 and (n or use >= MIN_TAIL_ONLY_TOKENS)
    )


def usable(shared: int, restored: int, limit: int, grid: int, whole: bool) -> int:
    """Tokens of a tail sharing `shared` with the prompt that a restore of `restored` tokens uses: within
    the prompt's `limit`, ending on the `grid`, and for a whole tail all of it or none."""
    use = min(shared, limit - restored)
    if grid:
        use -= (restored + use) % grid
    return 0 if whole and use != shared else use
