"""Per-request samplers and logits processors built on mlx-lm's sampling helpers, guarded.

Greedy requests get `None`, so BatchGenerator samples the whole batch with one call;
unseeded requests with the same parameters on one engine thread share one sampler object,
for the same reason (sequences with different samplers are sampled one by one: per step, a
top-p sort over the vocabulary per sequence); a seeded request draws each output position with
a key of its own (`SeededSampler`), so the same seed gives the same output whatever else shares
the batch and however speculation groups its tokens.

Every sampler and processor is `Guarded`: mlx-lm's filters are compiled with MLX's global
random state as an input and output, so one that raised while being traced left that state
an array without a primitive, and every later sampled request in the process failed. A
guarded call that raises repairs the state, falls back (argmax; logits unchanged) so the
step goes on for the other sequences, and keeps the error for the engine to fail the
requests that used it (`faults`).
"""

from __future__ import annotations

import functools
import secrets
import threading
from collections.abc import Callable, Iterable
from typing import Any

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


def repair_random_state() -> None:
    """Give MLX's global generator a fresh key (a failed compiled call leaves it unusable)."""
    mx.random.seed(secrets.randbits(64))


class Guarded:
    """A sampler or logits processor whose failure is kept for its requests (`error`) instead
    of failing the batch's step; called on the engine thread only."""

    failures = 0  # across all guards: an engine scans its requests only when this moved

    def __init__(self, fn: Callable[..., mx.array], fallback: Callable[..., mx.array]):
        self.fn = fn
        self.fallback = fallback
        self.error: Exception | None = None

    def __call__(self, *args: mx.array) -> mx.array:
        try:
            return self.fn(*args)
        except Exception as exc:  # any failure of a request's own sampling stays its own
            repair_random_state()
            self.error = exc
            Guarded.failures += 1
            return self.fallback(*args)


def _argmax(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def unchanged(tokens: mx.array, logits: mx.array) -> mx.array:
    return logits


def _filters(p: SamplingParams) -> list[Callable[[mx.array], mx.array]]:
    methods: list[Callable[[mx.array], mx.array]] = []
    if 0 < p.top_p < 1.0:
        methods.append(lambda x: apply_top_p(x, p.top_p))
    if p.min_p > 0.0:
        methods.append(lambda x: apply_min_p(x, p.min_p))
    if p.top_k > 0:
        methods.append(lambda x: apply_top_k(x, p.top_k))
    return methods


def build_sampler(p: SamplingParams) -> Guarded | None:
    """None means greedy (the batch's shared argmax sampler)."""
    if p.greedy:
        return None
    if p.seed is None:
        return _shared_sampler(p.temperature, p.top_p, p.min_p, p.top_k, threading.get_ident())
    return Guarded(SeededSampler(p), _argmax)


_GOLDEN = 0x9E3779B97F4A7C15  # spreads seeds apart before a position is added


class SeededSampler:
    """A seeded request's sampler: the token at output position t is drawn with a key of its
    own, made from the seed and t, so a seed gives the same tokens however the steps group them:
    one token a step, a verified draft's rows at once, rows moved between batches. Each call
    samples its rows at consecutive positions from `at`, which then moves past them; whoever
    keeps fewer tokens than it sampled (a rejected draft) sets `at` again."""

    def __init__(self, p: SamplingParams) -> None:
        self.seed = p.seed or 0
        self.methods = _filters(p)
        self.inv_temp = 1.0 / p.temperature
        self.at = 0  # the output position of the next token sampled

    def __call__(self, logprobs: mx.array) -> mx.array:
        for method in self.methods:
            logprobs = method(logprobs)
        rows = logprobs.reshape(-1, logprobs.shape[-1]) * self.inv_temp
        tokens = [mx.random.categorical(rows[i], key=self._key(self.at + i)) for i in range(rows.shape[0])]
        self.at += rows.shape[0]
        return mx.stack(tokens).reshape(logprobs.shape[:-1])

    def _key(self, position: int) -> mx.array:
        return mx.random.key((self.seed * _GOLDEN + position) % (1 << 64))


def shared(sampler: Any) -> bool:
    """Whether `sampler` draws its rows independently of who they belong to (not seeded)."""
    return not isinstance(getattr(sampler, "fn", None), SeededSampler)


def position_at(sampler: Any, position: int) -> None:
    """The next token `sampler` draws is the output's `position`-th (seeded samplers only)."""
    seeded = getattr(sampler, "fn", None)
    if isinstance(seeded, SeededSampler):
        seeded.at = position


@functools.lru_cache(maxsize=256)
def _shared_sampler(temperature: float, top_p: float, min_p: float, top_k: int, thread: int) -> Guarded:
    """mlx-lm's samplers keep no state of their own (they draw from MLX's global PRNG), so one
    serves every request of an engine thread with these parameters."""
    return Guarded(make_sampler(temp=temperature, top_p=top_p, min_p=min_p, top_k=top_k), _argmax)


def build_logits_processors(p: SamplingParams) -> list[Guarded]:
    processors = make_logits_processors(
        logit_bias=p.logit_bias or None,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty not in (None, 1.0) else None,
        presence_penalty=p.presence_penalty or None,
        frequency_penalty=p.frequency_penalty or None,
    )
    return [Guarded(fn, unchanged) for fn in processors]


def fault(sampler: Any, processors: Iterable[Any]) -> Exception | None:
    """The failure kept by a request's sampler or processors, if any."""
    for guard in (sampler, *processors):
        error = getattr(guard, "error", None)
        if error is not None:
            return error
    return None


def clear_faults(guards: Iterable[Any]) -> None:
    """Forget kept failures (once the requests that met them are failed)."""
    for guard in guards:
        if isinstance(guard, Guarded):
            guard.error = None
