"""Cancel a request's work when its client goes before the answer is ready.

A non-streaming request sends nothing until it is done, so nothing would notice the client
leaving: eight agents that gave up after a second each would hold a slot until `max_tokens`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response

T = TypeVar("T")

# nginx's "client closed request": logged, never seen by the client that left
CLIENT_CLOSED = 499


class ClientDisconnected(Exception):
    """The client went before its answer was ready; its work was cancelled."""


async def _disconnected(request: Request) -> None:
    """Return once the server reports the client gone (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """The result of `work`, which is cancelled (and `ClientDisconnected` raised) when the
    client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise ClientDisconnected()
    return task.result()


def client_closed_response() -> Response:
    return Response(status_code=CLIENT_CLOSED)
