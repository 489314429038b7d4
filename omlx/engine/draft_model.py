"""Drafts from a draft model: a smaller model of the same tokenizer (a model's `draft_model`
setting) proposes the next tokens greedily, for a request decoding alone (engine thread;
docs/design/speculation.md, "A draft model").

`DraftModelLookup` keeps `PromptLookup`'s adaptive length and rests, with the draft model in place
of the n-gram index. It holds the draft model's own KV cache for the request; before each draft
the cache is brought to the sequence's tokens (what a rejection left is trimmed, what was accepted
or emitted since is fed), so the prefix is computed once per request, at its first draft. A greedy
draft is a function of the tokens so far, so the verify's rule (a token is kept when the row before
it chose it) is rejection sampling for sampled requests too.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from omlx.engine.prompt_lookup import PromptLookup

PREFILL_CHUNK = 512  # the draft model's prefix is fed in chunks of this many tokens


class DraftModelLookup(PromptLookup):
    """Drafts for one sequence from `model` (greedy), at most `draft_max` long."""

    def __init__(self, tokens: Iterable[int], draft_max: int, model: Any) -> None:
        super().__init__([], draft_max)
        self.index = {}  # no n-gram index: `extend` only records the tokens
        self.model = model
        self.cache = make_prompt_cache(model)
        self.fed: list[int] = []  # the tokens in `cache`
        self.synced = 0  # `fed` and the sequence agree this far (`_sync`)
        self.extend(tokens)

    def draft(self, limit: int) -> list[int]:
        """The draft model's next `min(limit, length)` greedy tokens after the sequence ([] while
        resting)."""
        limit = min(limit, self.length)
        if self.rest or limit <= 0 or not self.tokens:
            return []
        self._sync()
        token, out = self.tokens[-1], []
        for _ in range(limit):
            logits = self.model(mx.array([[token]]), cache=self.cache)[0, -1]
            self.fed.append(token)
            token = int(mx.argmax(logits).item())
            out.append(token)
        return out

    def _sync(self) -> None:
        """Make the cache hold the sequence's tokens but its last. Only what came since the last
        draft is compared: the sequence only grows, and that draft fed all of it then."""
        want = len(self.tokens) - 1
        common, end = self.synced, min(len(self.fed), want)
        while common < end and self.fed[common] == self.tokens[common]:
            common += 1
        if common < len(self.fed):
            for c in self.cache:
                c.trim(len(self.fed) - common)
            del self.fed[common:]
        for start in range(common, want, PREFILL_CHUNK):
            chunk = self.tokens[start : min(start + PREFILL_CHUNK, want)]
            self.model(mx.array([chunk]), cache=self.cache)
            mx.eval([c.state for c in self.cache])
            self.fed += chunk
        self.synced = want


__all__ = ["DraftModelLookup"]
