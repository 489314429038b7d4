"""Where a running batch row decodes: in mlx-lm's `BatchGenerator` (one token a step) or in the
engine's `SpecBatch` (drafts verified in one pass), and the moves between them (engine thread;
docs/design/speculation.md, "Inside the batch").

Rows that may speculate (`may`) decode in the `SpecBatch` while every row of the `BatchGenerator`
may too, so a step is one decode forward pass either way; a row that may not (logits
processors, constrained, images) sends the `SpecBatch`'s rows back to the `BatchGenerator` until
it is gone. A row moves with its cache and the tokens in it; its last token is fed again where it
goes (the `BatchGenerator` has already computed the one after it, which is dropped).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from mlx_lm.generate import BatchGenerator

from omlx.engine.draft_model import DraftModelLookup
from omlx.engine.prompt_lookup import PromptLookup
from omlx.engine.request_state import RequestState, Status
from omlx.engine.spec_batch import SpecBatch
from omlx.engine.step_clock import StepClock
from omlx.engine.vision_lm import VisionLM

log = logging.getLogger("omlx.engine")


class BatchHost(Protocol):
    """The runner's side: its `BatchGenerator`, its rows by uid, and how a row is inserted there."""

    model: Any
    clock: StepClock
    bg: BatchGenerator
    batch: dict[int, RequestState]

    def batch_insert(self, state: RequestState, todo: list[int], cache: Any, fed: list[int], max_tokens: int) -> None: ...


class SpecRoute:
    """The `SpecBatch` of one engine (drafts of up to `draft_max` tokens; `eos_ids` end a row) and the
    moves in and out of it (`enabled`: batch rows speculate here and the model's layers roll back; a
    vision model's rows, whose caches carry rope deltas, never do: logged once)."""

    def __init__(self, host: BatchHost, draft_max: int, eos_ids: list[int], enabled: bool, model_id: str) -> None:
        self.host = host
        self.spec = SpecBatch(lambda: host.model, eos_ids, draft_max, host.clock)
        self.enabled = enabled and not isinstance(host.model, VisionLM)
        if enabled and not self.enabled:
            log.info("model=%s: batch rows do not speculate (a vision model's rows carry rope deltas)", model_id)

    def may(self, state: RequestState) -> bool:
        """The row may decode in the `SpecBatch` (no processors, constraint or images: `spec_aside`)."""
        return self.enabled and state.spec_aside is None

    def open(self) -> bool:
        """Every `BatchGenerator` row may speculate too."""
        return self.enabled and all(self.may(s) for s in self.host.batch.values())

    def join(self, state: RequestState, todo: list[int], cache: Any, fed: list[int], lookup: PromptLookup | None) -> bool:
        """Add a sequence prefilled or decoded on its own to the `SpecBatch` if it may go there now
        (one token left to feed); whether it did."""
        if len(todo) != 1 or not fed or not self.may(state) or not self.open():
            return False
        if isinstance(lookup, DraftModelLookup):  # batch rows draft from n-grams (speculation.md)
            lookup = None
        self.spec.add(state, cache, fed, todo[0], lookup)
        return True

    def route(self, decoded: list[RequestState]) -> None:
        """After a step: the rows the `BatchGenerator` just `decoded` move to the `SpecBatch` while it is
        open, else the `SpecBatch`'s rows go back to the `BatchGenerator`."""
        if not self.enabled:
            return
        if not self.open():
            if self.spec.rows and log.isEnabledFor(logging.DEBUG):
                other = next(s for s in self.host.batch.values() if not self.may(s))
                log.debug("%d batch rows stop drafting: request=%s cannot speculate (%s)", len(self.spec), other.id, other.spec_aside)
            for row in list(self.spec.rows):
                cache, fed, unfed = self.spec.remove(row.state) or ([], [], 0)
                left = row.state.request.max_tokens - row.state.completion_tokens
                self.host.batch_insert(row.state, [unfed], cache, fed, left)
            return
        moving = [s for s in decoded if s.status is not Status.FINISHED and self.host.batch.get(s.uid) is s]
        if not moving:
            return
        found = self.host.bg.remove([s.uid for s in moving], return_prompt_caches=True)
        joining = []
        for state in moving:
            del self.host.batch[state.uid]
            cache, tokens = found[state.uid][0], list(found[state.uid][1])
            for c in cache:  # the `BatchGenerator` fed the last token: it is fed again here
                c.trim(1)
            joining.append((state, cache, tokens[:-1], tokens[-1], None))
        self.spec.add_rows(joining)
        log.debug("%d batch rows move to the SpecBatch (%d rows there)", len(joining), len(self.spec))

    def take_out(self, state: RequestState) -> tuple[list[Any], list[int]] | None:
        """Take a running row out of wherever it decodes: its cache and the tokens in it."""
        found = self.spec.remove(state)
        if found is not None:
            return found[0], found[1]
        host = self.host
        if host.batch.get(state.uid) is not state:
            return None
        del host.batch[state.uid]
        in_batch = host.bg.remove([state.uid], return_prompt_caches=True).get(state.uid)
        return (in_batch[0], list(in_batch[1])) if in_batch is not None else None

    def extract(self, state: RequestState) -> tuple[list[Any], list[int]] | None:
        """A copy of a running row's cache and the tokens in it, wherever it decodes (None: neither)."""
        found = self.spec.extract(state)
        if found is not None or self.host.batch.get(state.uid) is not state:
            return found
        return self.host.bg.extract_cache([state.uid]).get(state.uid)

    def drop(self, state: RequestState) -> None:
        """Stop computing a running row, wherever it decodes."""
        if self.spec.remove(state) is None and self.host.batch.get(state.uid) is state:
            self.host.bg.remove([state.uid])
            del self.host.batch[state.uid]


__all__ = ["BatchHost", "SpecRoute"]
