"""The layer states a stateful model's sequence captures for the prefix cache: at the block
boundaries its prefill chunks end on and its decode steps cross, and at the prefill's end
(docs/design/cache-kinds.md, "The engine side")."""

from __future__ import annotations

from typing import Any

from omlx.cache.interface import BlockSpec


class Captures:
    """One sequence's snapshots by the token count they hold (`store`'s `boundary_states`), for a model
    whose `blocks` capture states (`BlockSpec.captures_states`)."""

    def __init__(self, blocks: BlockSpec, prompt_len: int, cached: int) -> None:
        self.blocks = blocks
        self.points = blocks.capture_points(prompt_len, cached)  # where prefill chunks must end
        self.states: dict[int, Any] = {}

    def take(self, cache: list[Any], length: int) -> None:
        """`cache` (a batch of one) holds `length` tokens now: keep its stateful layers' state."""
        state = self.blocks.snapshot(cache)
        if state is not None:
            self.states[length] = state

    def at_boundary(self, cache: list[Any], length: int) -> None:
        """`take` when `length` ends a block (a decode step crossed into the next one)."""
        if self.blocks.at_boundary(length):
            self.take(cache, length)

    def with_end(self, cache: list[Any], length: int) -> dict[int, Any]:
        """The states, and `cache`'s own at its `length` (a finished or paused sequence's end)."""
        self.take(cache, length)
        return dict(self.states)
