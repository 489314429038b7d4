"""Between an engine's thread and the asyncio loops of its callers.

Messages go in through the inbox (`put`, read by the engine thread with `messages`); events
come out through the outbox: each loop is woken once per step however many of its streams
advanced, and a loop that fell behind gets each stream's events merged into one.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from omlx.engine.device_fault import DEVICE
from omlx.engine.request import GenerationEvent
from omlx.engine.request_state import RequestState


class Bridge:
    """An engine's inbox and outbox; `put` and `stream` from the event loop, the rest from the
    engine thread."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox: dict[asyncio.AbstractEventLoop, dict[RequestState, GenerationEvent]] = {}
        self._lock = threading.Lock()

    def put(self, *message: Any) -> None:
        self.inbox.put(message)

    def messages(self, block: bool) -> Iterator[tuple]:
        """The messages waiting, one at a time (with `block`, the first waited for up to 0.5 s)."""
        try:
            message = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            yield message
            try:
                message = self.inbox.get_nowait()
            except queue.Empty:
                return

    def emit(self, state: RequestState, event: GenerationEvent) -> None:
        self.emit_many([(state, event)])

    def emit_many(self, items: list[tuple[RequestState, GenerationEvent]]) -> None:
        """Queue events for their event loops; each loop is woken once (a step's 32 events:
        one lock, one wake-up, rather than a wake-up racing the rest of the step for the GIL)."""
        wake = []
        with self._lock:
            for state, event in items:
                pending = self.outbox.get(state.loop)
                if pending is None:  # else a `_deliver` for this loop is already scheduled
                    pending = self.outbox[state.loop] = {}
                    wake.append(state.loop)
                earlier = pending.get(state)
                if earlier is None:
                    pending[state] = event
                else:
                    earlier.merge(event)
        for loop in wake:
            try:
                loop.call_soon_threadsafe(self._deliver, loop)
            except RuntimeError:  # the loop is closed: nobody is left to read these events
                with self._lock:
                    self.outbox.pop(loop, None)

    def _deliver(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the event loop: hand every waiting event to its request's queue."""
        with self._lock:
            pending = self.outbox.pop(loop, {})
        for state, event in pending.items():
            state.events.put_nowait(event)

    async def stream(self, state: RequestState) -> AsyncIterator[GenerationEvent]:
        """The request's events as they come, merged while the reader is behind; ends after
        the finish event (`state.done` set)."""
        while True:
            event: GenerationEvent = await state.events.get()
            while event.finish_reason is None and not state.events.empty():
                event.merge(state.events.get_nowait())
            if event.finish_reason is not None:
                state.done = True
            yield event
            if not state.first_out:
                # Runs after the callbacks queued so far, among them the wake-up of whoever
                # took the event on (an SSE stream's writer, `with_keepalive`): by then the
                # event is on its way out, and the engine may store the prompt's blocks.
                state.loop.call_soon(_mark_first_out, state)
            if state.done:
                return

    @staticmethod
    def answer(fn: Callable[[], Any], loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> None:
        """Engine thread: run `fn` and hand its result, or what it raised, to `future`."""
        try:
            DEVICE.raise_if_lost()
            result = fn()
        except Exception as exc:  # a thread boundary: delivered to the awaiting caller
            DEVICE.check(exc)
            loop.call_soon_threadsafe(_set_exception, future, exc)
        else:
            loop.call_soon_threadsafe(_set_result, future, result)


def _mark_first_out(state: RequestState) -> None:
    state.first_out = True


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
