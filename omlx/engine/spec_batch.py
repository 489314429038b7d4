"""Greedy batch rows decoded by the engine, with prompt-lookup drafts verified for all rows in one
forward pass (engine thread; docs/design/speculation.md, "Inside the batch").

`SpecBatch` holds rows as mlx-lm's left-padded `BatchKVCache` layers. Each step feeds every row its
unfed token and its own draft, right-padded to the longest (shape B x (1 + k)); a row accepts the
longest prefix of its draft that matches the tokens its rows chose (argmaxes, or draws with the
request's own sampler: rejection sampling, speculation.py) and emits them plus one. The rejected tokens
and the padding are rolled back per row with the cache's public methods: a uniform `trim` of what
every row rejected, then `prepare(right_padding=...)` and `finalize()`, which roll each row right by
its own rest so that those keys become its left padding (masked). Only rows without logits
processors, constraints or images, on models whose every layer is a plain `KVCache`, come here. How long the drafts verified
may be is `VerifyCost`'s: a wider step pays only where it costs less than the tokens it adds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from omlx.engine.prompt_lookup import PromptLookup
from omlx.engine.request_state import RequestState, TokenOut
from omlx.engine.sampling import position_at, shared
from omlx.engine.step_clock import PERF, StepClock
from omlx.engine.verify_cost import VerifyCost, acceptance


@dataclass(eq=False)
class SpecRow:
    """One row: `fed` are the tokens in its cache, `unfed` the sequence's last token (emitted, or
    the prompt's last), fed by the next step; `lookup` holds `fed + [unfed]`; `kept` draft tokens
    accepted here, `misses` drafts cut short by a rejection."""

    state: RequestState
    lookup: PromptLookup
    fed: list[int]
    unfed: int
    kept: int = 0
    misses: int = 0


class SpecBatch:
    """The rows the engine decodes itself with `model_of()`, the engine's current model, drafts as
    long as `cost` allows (engine thread only)."""

    def __init__(
        self,
        model_of: Callable[[], Any],
        eos_ids: Iterable[int],
        draft_max: int,
        clock: StepClock | None = None,
        cost: VerifyCost | None = None,
    ) -> None:
        self.model_of = model_of
        self.eos_ids = set(eos_ids)
        self.draft_max = draft_max
        self.clock = clock
        self.rows: list[SpecRow] = []
        self.cache: list[BatchKVCache] | None = None
        self.steps = 0  # forward passes made, and of them those that verified a draft
        self.verifies = 0
        self.cost = cost or VerifyCost()

    def __len__(self) -> int:
        return len(self.rows)

    def holds(self, state: RequestState) -> bool:
        return any(row.state is state for row in self.rows)

    def add(self, state: RequestState, cache: list[Any], fed: list[int], unfed: int, lookup: PromptLookup | None = None) -> None:
        """A row joins with its plain `KVCache` layers holding `fed` (not empty) and `unfed` to feed;
        `lookup` carries a solo speculation's drafts state, else one is made from the sequence."""
        self.add_rows([(state, cache, fed, unfed, lookup)])

    def add_rows(self, joining: list[tuple[RequestState, list[Any], list[int], int, PromptLookup | None]]) -> None:
        """Rows join as `add`'s, their caches merged into the batch's at once (one copy of it)."""
        if not joining:
            return
        for state, cache, fed, unfed, lookup in joining:
            assert fed and cache[0].offset == len(fed), "a row joins with its cache holding exactly `fed`"
            sequence = [*fed, unfed]
            if lookup is None:
                lookup = PromptLookup(sequence, self.draft_max)
            elif len(lookup.tokens) < len(sequence):
                lookup.extend(sequence[len(lookup.tokens) :])
            self.rows.append(SpecRow(state, lookup, list(fed), unfed))
        layers = zip(*(cache for _, cache, _, _, _ in joining), strict=True)
        merged = [BatchKVCache.merge(list(layer)) for layer in layers]
        if self.cache is None:
            self.cache = merged
        else:
            for mine, new in zip(self.cache, merged, strict=True):
                mine.extend(new)

    def extract(self, state: RequestState) -> tuple[list[Any], list[int]] | None:
        """A copy of the row's cache (plain `KVCache` layers) and the tokens in it; None if not here."""
        i = self._index(state)
        if i is None:
            return None
        assert self.cache is not None
        return [c.extract(i) for c in self.cache], list(self.rows[i].fed)

    def remove(self, state: RequestState) -> tuple[list[Any], list[int], int] | None:
        """Take the row out: (its cache, the tokens in it, its unfed token); None if not here."""
        i = self._index(state)
        if i is None:
            return None
        found = self.extract(state)
        assert found is not None
        row = self.rows[i]
        self._keep([j for j in range(len(self.rows)) if j != i])
        return found[0], found[1], row.unfed

    def clear(self) -> None:
        self.rows, self.cache = [], None

    def _index(self, state: RequestState) -> int | None:
        return next((i for i, row in enumerate(self.rows) if row.state is state), None)

    def _keep(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = None
            return
        assert self.cache is not None
        for c in self.cache:
            c.filter(keep)

    def step(self) -> list[TokenOut]:
        """One forward pass over every row: each row's tokens up to its first finish (EOS, a stop
        token, `max_tokens`); a finished row leaves, its cache and tokens on its last `TokenOut`."""
        assert self.cache is not None and self.rows
        drafts = [self._draft(row) for row in self.rows]
        k = self.cost.cap([(acceptance(row.kept, row.misses), len(d)) for row, d in zip(self.rows, drafts, strict=True)])
        drafts = [d[:k] for d in drafts]
        k = max(map(len, drafts))
        tic = PERF()
        rows = [[row.unfed, *d, *[row.unfed] * (k - len(d))] for row, d in zip(self.rows, drafts, strict=True)]
        logits = self.model_of()(mx.array(rows), cache=self.cache)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        best = mx.argmax(logprobs, axis=-1)
        drawn = self._drawn(logprobs, [1 + len(d) for d in drafts])
        built = PERF()
        mx.eval(best, logprobs, *drawn.values())
        chosen = best.tolist()
        for i, tokens in drawn.items():
            chosen[i] = tokens.tolist()
        if self.clock is not None:
            self.clock.decode_step(built - tic, 0.0, PERF() - built)
            self.clock.decoded_rows(len(self.rows), verified=k > 0)
        self.steps += 1
        self.verifies += k > 0
        kept = [_accepted(d, c) for d, c in zip(drafts, chosen, strict=True)]
        self._roll_back([k - a for a in kept])
        self.cost.observe(len(self.rows), 1 + k, PERF() - tic)
        outs: list[TokenOut] = []
        done: list[int] = []
        for i, (row, draft, a) in enumerate(zip(self.rows, drafts, kept, strict=True)):
            if draft:
                row.lookup.accepted(len(draft), a)
                row.kept, row.misses = row.kept + a, row.misses + (a < len(draft))
                row.state.drafted, row.state.accepted = row.lookup.drafted, row.lookup.kept
            emitted = chosen[i][: a + 1]
            position_at(row.state.sampler, row.state.completion_tokens + a + 1)
            before = len(row.fed)
            row.fed += [row.unfed, *draft[:a]]
            row.unfed = emitted[-1]
            row.lookup.extend(emitted)
            for j, token in enumerate(emitted):
                reason = self._finish(row.state, token, j)
                if reason is None:
                    outs.append(TokenOut(row.state, token, logprobs[i, j]))
                    continue
                cache = [c.extract(i) for c in self.cache]
                for c in cache:  # keep the tokens before this one, as a one-token step would
                    c.trim(len(row.fed) - (before + 1 + j))
                tokens = row.fed[: before + 1 + j]
                outs.append(TokenOut(row.state, token, logprobs[i, j], reason, prompt_cache=cache, all_tokens=tokens))
                done.append(i)
                break
        if done:
            self._keep([i for i in range(len(self.rows)) if i not in done])
        return outs

    def _drawn(self, logprobs: mx.array, widths: list[int]) -> dict[int, mx.array]:
        """The sampled rows' tokens for their first `widths[i]` verify rows, each drawn as a
        one-token step would draw it: a seeded sampler at the row's next output positions, a
        shared one (unseeded, same parameters) once for all its rows' verify rows together."""
        groups: dict[int, list[int]] = {}
        for i, row in enumerate(self.rows):
            if row.state.sampler is not None:
                position_at(row.state.sampler, row.state.completion_tokens)
                groups.setdefault(id(row.state.sampler), []).append(i)
        drawn: dict[int, mx.array] = {}
        for members in groups.values():
            sampler = self.rows[members[0]].state.sampler
            if len(members) == 1 or not shared(sampler):
                drawn.update((i, self.rows[i].state.sampler(logprobs[i, : widths[i]])) for i in members)
                continue
            tokens = sampler(mx.concatenate([logprobs[i, : widths[i]] for i in members]))
            ends = list(accumulate(widths[i] for i in members))
            drawn.update((i, tokens[end - widths[i] : end]) for i, end in zip(members, ends, strict=True))
        return drawn

    def _draft(self, row: SpecRow) -> list[int]:
        """The row's draft: never past `max_tokens` (it emits at most one token more than it drafts)."""
        if row.lookup.resting:
            return []
        left = row.state.request.max_tokens - row.state.completion_tokens
        return row.lookup.draft(left - 1)

    def _finish(self, state: RequestState, token: int, ahead: int) -> str | None:
        """Why `token`, `ahead` after the last one emitted, ends the request (None: it does not)."""
        req = state.request
        if token in self.eos_ids or token in req.stop_token_ids:
            return "stop"
        if state.completion_tokens + ahead + 1 >= req.max_tokens:
            return "length"
        return None

    def _roll_back(self, rejected: list[int]) -> None:
        """Drop each row's last `rejected[i]` keys and values: what all rows rejected is trimmed,
        the rest rolled into each row's left padding."""
        assert self.cache is not None
        common = min(rejected)
        rest = [r - common for r in rejected]
        for c in self.cache:
            if common:
                c.trim(common)
            if any(rest):
                c.prepare(right_padding=rest)
                c.finalize()
        if any(rest):  # now, so that the step's time (`VerifyCost`) holds its cost
            mx.eval([c.state for c in self.cache])


def _accepted(draft: list[int], chosen: list[int]) -> int:
    """How many of `draft` match the argmaxes before them (the longest matching prefix)."""
    n = 0
    while n < len(draft) and draft[n] == chosen[n]:
        n += 1
    return n


__all__ = ["SpecBatch", "SpecRow"]
