"""The layer states a stateful model's sequence captures for the prefix cache: at the block
boundaries its prefill chunks end on and its decode steps cross, and at the prefill's end
(docs/design/cache-kinds.md, "The engine side")."""

from __future__ import annotations

from typing import Any

from omlx.cache.interface import PrefixCacheInterface


def captures_states(prefix: PrefixCacheInterface) -> bool:
    """The model has stateful layers (windows, recurrent arrays) whose state must be captured."""
    block = prefix.block_size
    return block > 0 and bool(prefix.capture_points(2 * block, 0))


class Captures:
    """One sequence's snapshots by the token count they hold (`store`'s `boundary_states`)."""

    def __init__(self, prefix: PrefixCacheInterface, prompt_len: int, cached: int) -> None:
        self.prefix = prefix
        self.points = prefix.capture_points(prompt_len, cached)  # where prefill chunks must end
        self.states: dict[int, Any] = {}

    def take(self, cache: list[Any], length: int) -> None:
        """`cache` (a batch of one) holds `length` tokens now: keep its stateful layers' state."""
        state = self.prefix.snapshot(cache)
        if state is not None:
            self.states[length] = state

    def at_boundary(self, cache: list[Any], length: int) -> None:
        """`take` when `length` ends a block (a decode step crossed into the next one)."""
        if length % self.prefix.block_size == 0:
            self.take(cache, length)

    def with_end(self, cache: list[Any], length: int) -> dict[int, Any]:
        """The states, and `cache`'s own at its `length` (a finished or paused sequence's end)."""
        self.take(cache, length)
        return dict(self.states)
