"""What every API does around the engine: window checks, token budgets, n-way fan-out.

API modules build a `GenerationRequest` from their wire format with these
helpers and consume `GenerationEvent`s; nothing here knows a wire format.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from omlx.engine.llm_engine import LLMEngine
from omlx.engine.request import GenerationEvent, GenerationRequest, SamplingParams
from omlx.errors import EngineError, InvalidRequestError, OMLXError
from omlx.pool.model_settings import GenerationDefaults

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
FALLBACKS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}


def sampling_params(
    values: dict[str, Any],
    defaults: GenerationDefaults,
    *,
    seed: int | None,
    logit_bias: dict[str, float] | None,
    vocab_size: int,
) -> SamplingParams:
    """The request's sampling values over the model's (or profile's) defaults, in the engine's
    form: a top-k of 0, below or at/beyond the vocabulary is no limit, a seed is taken modulo
    2**64, and `logit_bias` must name tokens of this vocabulary (wire bounds: `api/wire.py`)."""
    chosen: dict[str, Any] = {}
    for name in SAMPLING_FIELDS:
        value = values.get(name)
        if value is None:
            value = getattr(defaults, name)
        chosen[name] = FALLBACKS.get(name) if value is None else value
    if not 0 < chosen["top_k"] < vocab_size:
        chosen["top_k"] = 0
    bias = None
    if logit_bias:
        bias = {int(key): value for key, value in logit_bias.items()}
        outside = [tok for tok in bias if tok >= vocab_size]
        if outside:
            raise InvalidRequestError(
                f"logit_bias names token {outside[0]}, outside the vocabulary (0..{vocab_size - 1}).",
                param="logit_bias",
            )
    return SamplingParams(**chosen, seed=None if seed is None else seed % 2**64, logit_bias=bias)


def completion_budget(
    engine: LLMEngine,
    prompt_len: int,
    requested: int | None,
    default: int,
    *,
    window_cap: int | None = None,
    allow_zero: bool = False,
    cap: int | None = None,
) -> int:
    """Clamp the completion length to what is left of the context window, and to `cap` (the
    model's `max_tokens_cap`).

    A prompt that does not fit is refused with both numbers; it is never truncated.
    """
    window = min(engine.context_length, window_cap or engine.context_length)
    if prompt_len >= window and not (allow_zero and requested == 0 and prompt_len <= window):
        raise InvalidRequestError(
            f"The prompt is {prompt_len} tokens, but model '{engine.model_id}' has a context "
            f"window of {window} tokens. Shorten the prompt.",
            param="messages",
            code="context_length_exceeded",
        )
    held = getattr(engine, "max_sequence_tokens", None)  # what this device's memory can hold
    if held is not None and held < window:
        if prompt_len >= held and not (allow_zero and requested == 0):
            budget = engine.kv_budget
            raise InvalidRequestError(
                f"The prompt is {prompt_len} tokens, but this device's memory holds the KV cache of at "
                f"most {held} tokens of model '{engine.model_id}' ({budget.bytes_per_token} bytes per "
                "token; see --max-kv-memory). Shorten the prompt.",
                param="messages",
                code="context_length_exceeded",
            )
        window = held
    wanted = default if requested is None else requested
    if cap is not None:
        wanted = min(wanted, cap)
    return max(0 if allow_zero else 1, min(wanted, window - prompt_len))


def event_error(ev: GenerationEvent) -> OMLXError:
    """The error a failed request's last event reports: the caller's (its own grammar could not
    go on: 400) or the engine's (500)."""
    message = ev.error or "generation failed"
    if ev.error_type == InvalidRequestError.error_type:
        return InvalidRequestError(message)
    return EngineError(message)


@dataclass
class Collected(GenerationEvent):
    """All events of one sequence folded into a final result (an engine error is raised)."""

    def add(self, ev: GenerationEvent) -> None:
        if ev.finish_reason == "error":
            raise event_error(ev)
        self.merge(ev)


async def collect(engine: LLMEngine, requests: list[GenerationRequest]) -> list[Collected]:
    """Run requests concurrently (they batch together) and fold each one's events."""

    async def one(req: GenerationRequest) -> Collected:
        out = Collected()
        async for ev in engine.generate(req):
            out.add(ev)
        return out

    return list(await asyncio.gather(*(one(r) for r in requests)))


async def merged(engine: LLMEngine, requests: list[GenerationRequest]) -> AsyncIterator[tuple[int, GenerationEvent]]:
    """Interleave the event streams of several requests, tagged by index."""
    if len(requests) == 1:
        async for ev in engine.generate(requests[0]):
            yield 0, ev
        return
    queue: asyncio.Queue[tuple[int, GenerationEvent | None]] = asyncio.Queue()

    async def pump(i: int, req: GenerationRequest) -> None:
        try:
            async for ev in engine.generate(req):
                await queue.put((i, ev))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(requests)]
    remaining = len(tasks)
    try:
        while remaining:
            i, ev = await queue.get()
            if ev is None:
                remaining -= 1
                continue
            yield i, ev
    finally:
        for t in tasks:
            t.cancel()


def fan_out(base: GenerationRequest, n: int) -> list[GenerationRequest]:
    """n choices = n sequences; seeded ones get distinct but reproducible seeds."""
    if n == 1:
        return [base]
    out = []
    for i in range(n):
        seed = base.sampling.seed + i if base.sampling.seed is not None else None
        out.append(replace(base, request_id=f"{base.request_id}-{i}", sampling=replace(base.sampling, seed=seed)))
    return out


def usage_dict(prompt: int, completion: int, cached: int, cache: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        **omlx_usage(cache),
    }


def omlx_usage(cache: dict[str, Any] | None) -> dict[str, Any]:
    """The usage's extra `omlx` field: the prompt's restore by tier and why not more (`CacheReport.to_dict`;
    docs/cache.md, "What a client sees"); none where the engine made no report."""
    return {} if cache is None else {"omlx": {"cache": cache}}
