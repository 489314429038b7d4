"""Per-request samplers and logits processors built on mlx-lm's sampling helpers.

Greedy requests get `None`, so BatchGenerator samples the whole batch with one
call; unseeded requests with the same parameters share one sampler object, for the same
reason (sequences with different samplers are sampled one by one: per step, a top-p sort
over the vocabulary per sequence); a seeded request carries its own PRNG key so the same
seed gives the same output whatever else shares the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)

from omlx.engine.request import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def _filters(p: SamplingParams) -> list[Callable[[mx.array], mx.array]]:
    methods: list[Callable[[mx.array], mx.array]] = []
    if 0 < p.top_p < 1.0:
        methods.append(lambda x: apply_top_p(x, p.top_p))
    if p.min_p > 0.0:
        methods.append(lambda x: apply_min_p(x, p.min_p))
    if p.top_k > 0:
        methods.append(lambda x: apply_top_k(x, p.top_k))
    return methods


def build_sampler(p: SamplingParams) -> Sampler | None:
    """None means greedy (the batch's shared argmax sampler)."""
    if p.greedy:
        return None
    if p.seed is None:
        return _shared_sampler(p.temperature, p.top_p, p.min_p, p.top_k)
    methods = _filters(p)
    inv_temp = 1.0 / p.temperature
    state = {"key": mx.random.key(p.seed)}

    def seeded(logprobs: mx.array) -> mx.array:
        for method in methods:
            logprobs = method(logprobs)
        state["key"], sub = mx.random.split(state["key"])
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return seeded


@functools.lru_cache(maxsize=256)
def _shared_sampler(temperature: float, top_p: float, min_p: float, top_k: int) -> Sampler:
    """mlx-lm's samplers keep no state (they draw from MLX's global PRNG), so one serves
    every request with these parameters."""
    return make_sampler(temp=temperature, top_p=top_p, min_p=min_p, top_k=top_k)


def build_logits_processors(p: SamplingParams) -> list[Callable]:
    return make_logits_processors(
        logit_bias=p.logit_bias or None,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty not in (None, 1.0) else None,
        presence_penalty=p.presence_penalty or None,
        frequency_penalty=p.frequency_penalty or None,
    )
