"""Prompt-lookup (n-gram) drafts for one sequence, with the draft length adapted to what it
accepts (pure Python; docs/design/speculation.md).

`PromptLookup` holds the sequence's tokens (prompt and output) and an index of their n-grams
that have a continuation. `draft(limit)` returns the tokens that followed the latest earlier
occurrence of the sequence's last `n` tokens (the longest `n` that matches first), at most the
current draft length; `accepted(drafted, kept)` adapts that length and, while acceptance
stays low, rests (drafts nothing) for a number of tokens that doubles each time, then retries.
"""

from __future__ import annotations

from collections.abc import Iterable

# n-gram sizes tried, longest first: a single token is too weak a signal to draft on
NGRAMS = (4, 3, 2)
FIRST_DRAFT = 4  # draft length to start with (grows on full acceptance, up to the maximum)
WINDOW = 32  # drafted tokens over which acceptance is judged
LOW_ACCEPTANCE = 0.3  # below it (over a full window) the sequence rests
REST_TOKENS = 16  # first rest; doubles on each low window, up to MAX_REST_TOKENS
MAX_REST_TOKENS = 256
MISS_STREAK = 8  # lookups in a row that found nothing: rest too (REST_TOKENS), so free text stays pipelined


class PromptLookup:
    """Drafts for one sequence (engine thread; no MLX)."""

    def __init__(self, tokens: Iterable[int], draft_max: int) -> None:
        self.tokens: list[int] = []
        self.draft_max = max(1, draft_max)
        self.length = min(FIRST_DRAFT, self.draft_max)  # the next draft's length
        self.index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in NGRAMS}
        self.window_drafted = 0
        self.window_kept = 0
        self.rest = 0  # tokens to go before drafting again
        self.next_rest = REST_TOKENS
        self.misses = 0
        self.drafted = 0  # totals, for the request's log line and metrics
        self.kept = 0
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens of the sequence (prompt, then output as it is emitted)."""
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1  # the n-grams ending before this token now have a continuation
            for n, index in self.index.items():
                if end >= n:
                    index[tuple(self.tokens[end - n : end])] = end
            if self.rest:
                self.rest -= 1

    @property
    def resting(self) -> bool:
        """It drafts nothing now (its acceptance was low, or lookups kept missing)."""
        return self.rest > 0

    def draft(self, limit: int) -> list[int]:
        """The next draft after the sequence's tokens: at most `limit` and the current length
        ([] while resting or when no n-gram of its end occurred before)."""
        limit = min(limit, self.length)
        if self.rest or limit <= 0:
            return []
        size = len(self.tokens)
        for n in NGRAMS:
            if size <= n:
                continue
            start = self.index[n].get(tuple(self.tokens[size - n :]))
            if start is not None:
                self.misses = 0
                # copied as LZ77 copies: a match overlapping the end repeats what it drafted
                draft = self.tokens[start : start + limit]
                while len(draft) < limit:
                    draft.append(draft[len(draft) - (size - start)])
                return draft
        self.misses += 1
        if self.misses >= MISS_STREAK:
            self.misses = 0
            self.rest = REST_TOKENS
        return []

    def accepted(self, drafted: int, kept: int) -> None:
        """A draft of `drafted` tokens was verified and its first `kept` accepted."""
        self.drafted += drafted
        self.kept += kept
        if kept == drafted:
            self.length = min(self.draft_max, self.length * 2)
        else:
            self.length = max(1, min(self.draft_max, kept + 1))
        self.window_drafted += drafted
        self.window_kept += kept
        if self.window_drafted >= WINDOW:
            if self.window_kept < LOW_ACCEPTANCE * self.window_drafted:
                self.rest = self.next_rest
                self.next_rest = min(MAX_REST_TOKENS, self.next_rest * 2)
                self.length = min(FIRST_DRAFT, self.draft_max)
            else:
                self.next_rest = REST_TOKENS
            self.window_drafted = self.window_kept = 0


__all__ = ["PromptLookup"]
