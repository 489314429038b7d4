"""The runner's stores into the prefix cache (`PromptStores`): prompts after their prefill, what a
cancelled request computed, and the layer states a stateful model's batch rows capture for them
(docs/design/cache-kinds.md). Engine thread only."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from omlx.cache.block.hashing import ExtraKeys
from omlx.cache.interface import PrefixCacheInterface
from omlx.cache.plan.tails import MIN_TAIL_ONLY_TOKENS
from omlx.engine.request_state import RequestState

log = logging.getLogger("omlx.engine")


class PromptStores:
    """One engine's stores into its prefix `cache`; `extract(state)` copies a running batch row's
    cache and the tokens in it (None: not running), `model_id` names the model in logs."""

    def __init__(
        self, cache: PrefixCacheInterface, extract: Callable[[RequestState], tuple[list[Any], list[int]] | None], model_id: str
    ) -> None:
        self.cache = cache
        self.extract = extract
        self.model_id = model_id
        self.stateful = cache.blocks.captures_states

    def store(
        self, tokens: list[int], cache: list[Any], *, final: bool, start: int = 0, boundary_states: Any = None,
        image_keys: ExtraKeys | None = None,
    ) -> int:
        """Store blocks in the prefix cache; where blocks left for a later call begin (0:
        none). Caching is an optimisation: its failure is logged, never fails the request."""
        try:
            return self.cache.store(
                tokens, cache, final=final, start=start, boundary_states=boundary_states, image_keys=image_keys
            ) or 0
        except Exception:
            log.exception("storing prefix-cache blocks for %s failed", self.model_id)
            return 0

    def _store_of(self, state: RequestState, tokens: list[int], cache: list[Any]) -> None:
        """Store what `state`'s sequence computed of `tokens` so far (not final: the engine goes on)."""
        self.store(tokens, cache, final=False, boundary_states=self.states(state), image_keys=state.request.image_keys)

    def store_batch_prompt(self, state: RequestState) -> None:
        cache_and_tokens = self.extract(state)
        if cache_and_tokens is not None:
            # the prompt alone: its unfinished last block must be keyed by prompt tokens only,
            # so the same prompt finds it again (also after a restart)
            prompt = list(cache_and_tokens[1])[: self.prompt_stored(state)]
            if len(prompt) == self.prompt_stored(state) or state.plan.worth_storing(len(prompt), state.cached_tokens):
                self._store_of(state, prompt, cache_and_tokens[0])

    def prompt_stored(self, state: RequestState) -> int:
        """Tokens of a prompt its store takes: a stateful model's tail ends where its prefill
        did, before the last token (the state held there serves the same prompt again)."""
        return state.prompt_len - 1 if state.captures is not None else state.prompt_len

    def states(self, state: RequestState) -> dict[int, Any] | None:
        return dict(state.captures.states) if state.captures is not None else None

    def store_solo_prompt(self, state: RequestState, now: bool = False) -> None:
        """A solo prefill's prompt blocks, once its first token is out (or `now`)."""
        if state.store_prompt and (now or state.first_token_out()):
            state.store_prompt = False
            prompt = state.solo.fed[: self.prompt_stored(state)]
            self._store_of(state, prompt, state.solo.cache)

    def store_computed_prompt(self, state: RequestState, due: bool) -> None:
        """A request cancelled keeps what its prompt computed: a prompt store waiting for the
        first token (`due`) is made now, and a prefill cut short stores the blocks fed so far,
        so a client that retries continues where it left (before the sequence's cache goes)."""
        if state.solo is not None:
            solo = state.solo
            if solo.prefilling:
                fed = solo.fed[: state.prompt_len]
                if state.plan.worth_storing(len(fed), state.cached_tokens):
                    self._store_of(state, fed, solo.cache)
            else:
                self.store_solo_prompt(state, now=True)
        elif due or state.first_token is None:
            self.store_batch_prompt(state)

    def capture_in_batch(self, state: RequestState, r: Any) -> dict[int, Any] | None:
        """A stateful batch row's state where this step made its length a block multiple; on its
        finish, all of its states with its end's (for the store)."""
        captures = state.captures
        if captures is None:
            return None
        if r.finish_reason is not None:
            return captures.with_end(r.prompt_cache, len(r.all_tokens))
        self.capture_row(state, state.prompt_len + state.completion_tokens + 1)  # this token is in now
        return None

    def capture_row(self, state: RequestState, length: int) -> None:
        """A stateful batch row's state, taken when it holds `length` tokens, a block multiple."""
        if state.captures is not None and self.cache.blocks.at_boundary(length):
            found = self.extract(state)
            if found is not None:
                state.captures.take(found[0], length)

    def wants_prompt_blocks(self, state: RequestState) -> bool:
        """Whether a just-prefilled prompt is worth storing now: new full blocks, or for a
        stateful model also a tail long enough to serve the same prompt again alone."""
        cached, plan = state.cached_tokens, state.plan
        if self.stateful and state.prompt_len - 1 - cached >= MIN_TAIL_ONLY_TOKENS:
            return plan.worth_storing(cached + self.cache.blocks.block_size, cached)
        return plan.worth_storing(state.prompt_len, cached)
