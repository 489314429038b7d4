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
from omlx.engine.request import GenerationEvent, GenerationRequest
from omlx.errors import EngineError, InvalidRequestError


def completion_budget(
    engine: LLMEngine,
    prompt_len: int,
    requested: int | None,
    default: int,
    *,
    window_cap: int | None = None,
    allow_zero: bool = False,
) -> int:
    """Clamp the completion length to what is left of the context window.

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
    wanted = default if requested is None else requested
    return max(0 if allow_zero else 1, min(wanted, window - prompt_len))


@dataclass
class Collected(GenerationEvent):
    """All events of one sequence folded into a final result (an engine error is raised)."""

    def add(self, ev: GenerationEvent) -> None:
        if ev.finish_reason == "error":
            raise EngineError(ev.error or "generation failed")
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


def usage_dict(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
