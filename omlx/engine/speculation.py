"""Prompt-lookup speculation for the solo sequence: a draft from the request's own tokens
(`PromptLookup`) verified in one forward pass, the rejected tokens trimmed from the cache
(engine thread; docs/design/speculation.md).

Requests without logits processors, constraints or images, on models whose every layer is a
plain `KVCache`, speculate; the others step aside (`step_aside` names why). Each row of the verify
is sampled as the one-token step would sample it (the argmax, or a draw with the request's own
sampler), and a draft token is accepted when the row before it chose it: the output is unchanged
but for float near-ties between a (1 + k)-row and a 1-row forward pass. For a sampled request
this is rejection sampling against a deterministic draft: a draft token d is accepted with the
target's probability p(d), and on a rejection the token drawn is distributed as p without d,
renormalised, the residual the method resamples from (docs/design/speculation.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from omlx.engine.config import EngineConfig
from omlx.engine.draft_model import DraftModelLookup
from omlx.engine.prompt_lookup import PromptLookup
from omlx.engine.request_state import RequestState, TokenOut
from omlx.engine.sampling import position_at
from omlx.engine.solo import SoloSequence, plain_kv
from omlx.engine.step_clock import PERF

log = logging.getLogger("omlx.engine")
MakeOut = Callable[[RequestState, int, Any, int, Callable[[], None]], TokenOut]


def step_aside(enabled: bool, processors: list[Any], constrained: bool, cache: list[Any], images: bool = False) -> str | None:
    """Why a solo request does not speculate (None: it does)."""
    if not enabled:
        return "off"
    if images:  # its prompt holds image keys past the vocabulary, and its positions are M-RoPE's
        return "images"
    if constrained:
        return "constrained"
    if processors:
        return "logits processors"
    if not plain_kv(cache):
        return "cache layers that cannot roll back"
    return None


def model_speculates(model: Any, model_id: str) -> bool:
    """Whether the model's cache can roll a draft back (every layer a plain `KVCache`); logs
    the reason once when it cannot (engine thread, at load)."""
    if plain_kv(make_prompt_cache(model)):
        return True
    log.info("model=%s does not speculate: its sliding-window or recurrent layers cannot roll back a draft", model_id)
    return False


def request_aside(state: RequestState, enabled: bool) -> str | None:
    """Why an inserted request does not speculate (None: it does), logged once (`enabled`: speculation
    is on and the model's cache kinds roll back, `model_speculates`)."""
    req = state.request
    why = step_aside(enabled, state.processors, req.constraint is not None, [],
                     images=req.vision is not None)  # fmt: skip
    if why is not None and why != "off":
        log.debug("request=%s does not speculate: %s", state.id, why)
    return why


def speculation_for(
    state: RequestState, config: EngineConfig, eos_ids: list[int], draft_model: Any = None
) -> Speculation | None:
    """The solo request's speculation, unless it steps aside (`state.spec_aside`, or its cache):
    drafts from `draft_model` where the model has one, else from the request's own n-grams."""
    req = state.request
    if state.spec_aside is None and plain_kv(state.solo.cache):
        lookup = (
            DraftModelLookup(req.prompt_tokens, config.draft_max, draft_model)
            if draft_model is not None
            else PromptLookup(req.prompt_tokens, config.draft_max)
        )
        return Speculation(lookup, {*eos_ids, *req.stop_token_ids})
    return None


class Speculation:
    """One request's speculation while it decodes as the solo sequence."""

    def __init__(self, lookup: PromptLookup, stops: set[int]) -> None:
        self.lookup = lookup  # the drafts: n-grams of the sequence, or a draft model's
        self.stops = stops  # tokens that end the request: nothing is drafted after them

    def ready(self, seq: SoloSequence) -> bool:
        """Catch up with the tokens `seq` has fed; whether a draft may be looked for (it costs
        the step's pipelining: the pending token must be on the host first)."""
        known = len(self.lookup.tokens)
        if known < len(seq.fed):
            self.lookup.extend(seq.fed[known:])
        return not self.lookup.resting

    def step(self, seq: SoloSequence, allowed: int, at: int) -> tuple[list[tuple[int, Any]], int] | None:
        """With `allowed` tokens left to emit, the pending one the output's `at`-th: it and the
        accepted draft tokens (token, logprobs) with the depth the first was fed at, or None when
        there is no draft (the caller steps as usual). The token after them is left pending,
        already computed. A draft token is accepted when the row before it draws it (module doc)."""
        assert seq.pending is not None and len(self.lookup.tokens) == len(seq.fed)
        token, logprobs = seq.pending
        tic = PERF()
        first = int(token.item())  # the wait a one-token step makes too
        waited = PERF() - tic
        self.lookup.extend([first])
        draft = self.lookup.draft(allowed - 1) if first not in self.stops else []
        if not draft:  # `first` is fed by the usual step: the lookup already holds it
            if seq.clock is not None:
                seq.clock.decode_step(0.0, 0.0, waited)
            return None
        base = len(seq.fed)
        tic = PERF()
        logits = seq.model(mx.array([[first, *draft]]), cache=seq.cache)[0]
        rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        position_at(seq.sampler, at + 1)
        best = seq.sampler(rows)  # argmax, or each row drawn as a one-token step would (below)
        built = PERF()
        mx.eval(best, rows)
        if seq.clock is not None:
            seq.clock.decode_step(built - tic, 0.0, waited + PERF() - built)
            seq.clock.decoded_rows(1, verified=True)
        chosen = best.tolist()
        kept = 0
        while kept < len(draft) and draft[kept] == chosen[kept]:
            kept += 1
        position_at(seq.sampler, at + kept + 2)  # the rows after the new pending one are drawn again
        self.lookup.accepted(len(draft), kept)
        if kept < len(draft):
            for c in seq.cache:
                c.trim(len(draft) - kept)
        seq.fed += [first, *draft[:kept]]
        self.lookup.extend(draft[:kept])
        seq.pending = (best[kept : kept + 1], rows[kept])
        return [(first, logprobs), *((chosen[i], rows[i]) for i in range(kept))], base

    def outs(self, state: RequestState, allowed: int, out: MakeOut) -> list[TokenOut] | None:
        """The solo request's next tokens from a verified draft, up to the first that ends it
        (`out(state, token, logprobs, ahead, cut)` makes each), or None when it has no draft now."""
        seq = state.solo
        got = self.step(seq, allowed, state.completion_tokens) if self.ready(seq) else None
        if got is None:
            return None
        state.drafted, state.accepted = self.lookup.drafted, self.lookup.kept
        tokens, depth = got
        outs: list[TokenOut] = []
        for i, (token, logprobs) in enumerate(tokens):
            outs.append(out(state, token, logprobs, i, lambda i=i: self.cut(seq, depth + i)))
            if outs[-1].finish_reason is not None:
                break
        return outs

    @staticmethod
    def cut(seq: SoloSequence, depth: int) -> None:
        """The sequence ended at the token fed at `depth`: the cache keeps what came before it,
        as a one-token step's would, and nothing is pending."""
        extra = len(seq.fed) - depth
        if extra > 0:
            for c in seq.cache:
                c.trim(extra)
            del seq.fed[depth:]
        seq.pending = None


__all__ = ["Speculation", "model_speculates", "request_aside", "speculation_for", "step_aside"]
