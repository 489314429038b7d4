"""Server-sent events helpers, including keep-alives while a long prefill runs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

T = TypeVar("T")

KEEPALIVE = object()


def sse_data(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_event(name: str, payload: Any) -> str:
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def with_keepalive(source: AsyncIterator[T], interval: float) -> AsyncIterator[T | object]:
    """Yield from `source`, yielding KEEPALIVE whenever `interval` s pass without an item.

    The pending `__anext__` is never cancelled by a timeout, only when we are closed.
    """
    pending: asyncio.Task | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(source.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield KEEPALIVE
                continue
            task, pending = pending, None
            try:
                yield task.result()
            except StopAsyncIteration:
                return
    finally:
        if pending is not None:
            pending.cancel()
            try:
                await pending
            except (asyncio.CancelledError, StopAsyncIteration):
                pass
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()
