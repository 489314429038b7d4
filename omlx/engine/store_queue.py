"""Finished sequences' blocks on their way into the prefix cache (engine thread).

They are stored once every event of the step has gone out (`store_finished`), and what a
store leaves for later is done a piece per idle loop (`continue_store`): a whole long
prompt stored at once holds the engine while a new request waits (docs/design/solo-path.md,
"Stores"). Each pending store holds its sequence's whole KV cache meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger("omlx.engine")

# Finished requests whose blocks may wait to be stored a piece per idle loop; past it the
# oldest is stored at once.
MAX_PENDING_STORES = 2

# store(tokens, cache, final=..., start=..., boundary_states=..., image_keys=...) -> where the blocks
# left for later begin (0: none)
Store = Callable[..., int]


class StoreQueue:
    """The stores of finished sequences, in order; `store` never raises. Each carries its
    sequence's tokens, cache, boundary states (stateful layers) and image keys."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.finished: list[tuple[list[int], Any, Any, Any]] = []  # stored after this step's events
        self.pending: deque[tuple[list[int], Any, int, Any, Any]] = deque()  # (tokens, cache, from, states, keys)

    def add(self, tokens: list[int], cache: Any, states: Any = None, image_keys: Any = None) -> None:
        """A finished sequence's blocks (`states`: its layers' boundary states, if stateful;
        `image_keys`: its images' extra block keys), stored by the next `store_finished`."""
        self.finished.append((tokens, cache, states, image_keys))

    def add_pending(self, tokens: list[int], cache: Any, start: int, states: Any = None, image_keys: Any = None) -> None:
        """What a store left from `start` on (0: nothing)."""
        if start:
            self.pending.append((tokens, cache, start, states, image_keys))

    def store_finished(self) -> None:
        """Store the finished sequences' blocks; what is left waits for idle loops."""
        done, self.finished = self.finished, []
        for tokens, cache, states, keys in done:
            start = self.store(tokens, cache, final=True, boundary_states=states, image_keys=keys)
            self.add_pending(tokens, cache, start, states, keys)
        while len(self.pending) > MAX_PENDING_STORES:  # each holds a whole KV cache
            self.finish_pending(0)

    def continue_store(self) -> bool:
        """The next piece of the oldest pending store; True while any remain."""
        tokens, cache, start, states, keys = self.pending.popleft()
        start = self.store(tokens, cache, final=True, start=start, boundary_states=states, image_keys=keys)
        if start:
            self.pending.appendleft((tokens, cache, start, states, keys))
        return bool(self.pending)

    def finish_pending(self, index: int) -> None:
        tokens, cache, start, states, keys = self.pending[index]
        del self.pending[index]
        while start:
            start = self.store(tokens, cache, final=True, start=start, boundary_states=states, image_keys=keys)

    def finish_for(self, prompt: list[int]) -> None:
        """A prompt that goes on past where a pending store stopped (the next turn of that
        conversation) would find only its first pieces: that store is finished first."""
        for i in reversed(range(len(self.pending))):
            tokens, _, start, _, _ = self.pending[i]
            if len(prompt) > start and prompt[: start + 1] == tokens[: start + 1]:
                self.finish_pending(i)

    def drain(self, seconds: float, go_on: Callable[[], bool], model_id: str) -> None:
        """At shutdown: go on with the pending stores for up to `seconds` while `go_on()`,
        then let the rest go."""
        deadline = time.monotonic() + seconds
        while self.pending and go_on() and time.monotonic() < deadline:
            self.continue_store()
        if self.pending:
            log.info("%s: %d finished requests' blocks not stored at shutdown", model_id, len(self.pending))
            self.pending.clear()

    def clear(self) -> None:
        self.finished = []
        self.pending.clear()
