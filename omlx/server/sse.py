"""Server-sent events helpers, including keep-alives while a long prefill runs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import anyio
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

KEEPALIVE = object()
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventStream(StreamingResponse):
    """A server-sent event stream that stops as soon as its client goes, in any phase (a
    long prefill sends nothing for minutes), and then runs its `on_close` callbacks: the
    engine's requests are cancelled, their places and the model's lease given back."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None] | None = None):
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
        self.on_close: list[Callable[[], None]] = [on_close] if on_close else []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went while we wrote
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
                for callback in self.on_close:
                    callback()


def sse_data(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def sse_event(name: str, payload: Any) -> str:
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def with_keepalive(source: AsyncIterator[T], interval: float) -> AsyncIterator[T | object]:
    """Yield from `source`, yielding KEEPALIVE whenever `interval` s pass without an item.

    One task reads `source` for the whole stream and a timer is armed only while nothing
    is queued: a task and a wait per item cost the event loop several times more per token,
    time it shares with the engine thread under one GIL (docs/design/serving-layer.md).
    Closing this generator cancels the reader, which closes `source` (an engine stream then
    cancels its request).
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def read() -> None:
        try:
            async for item in source:
                queue.put_nowait((_ITEM, item))
        except Exception as exc:  # re-raised on the consumer's side
            queue.put_nowait((_FAILED, exc))
        else:
            queue.put_nowait((_END, None))

    reader = asyncio.create_task(read())
    try:
        while True:
            if queue.empty():
                timer = loop.call_later(interval, queue.put_nowait, (_TICK, None))
                try:
                    kind, value = await queue.get()
                finally:
                    timer.cancel()
            else:
                kind, value = queue.get_nowait()
            if kind == _ITEM:
                yield value
            elif kind == _TICK:
                yield KEEPALIVE
            elif kind == _END:
                return
            else:
                raise value
    finally:
        if not reader.done():
            reader.cancel()
        try:
            await reader
        except asyncio.CancelledError:
            pass
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            await aclose()


_ITEM, _TICK, _END, _FAILED = range(4)
