"""Where an engine's decode steps spend their time: building the step's graph, launching it,
waiting for the device, the prefix cache's work on the engine thread, other host work, and both
threads' CPU (docs/design/step-clock.md). Engine thread only, except `snapshot`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

PERF = time.perf_counter
PARTS = ("graph_build", "launch", "device_wait", "cache", "host")


class StepClock:
    """Totals over the decode-only loops of one engine (seconds, tokens)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self.verify_totals: dict[str, float] = dict.fromkeys(PARTS, 0.0)  # the loops that verified drafts
        self.loops = 0
        self.tokens = 0
        self.rows = 0  # sequences the counted loops decoded, summed: rows / loops is the mean batch
        self.verify_loops = 0  # counted loops whose step verified drafts, and the rows of those steps
        self.verify_rows = 0
        self._rows = self._verify_rows = 0
        self.engine_tid: int | None = None
        self._parts = dict.fromkeys(PARTS[:4], 0.0)
        self._prefilled = False
        self._started = 0.0
        self._built_at = self._step_tic = 0.0

    def start_loop(self) -> None:
        """A loop begins (one that prefills anything is not counted)."""
        parts = self._parts
        for name in parts:
            parts[name] = 0.0
        self._prefilled = False
        self._rows = self._verify_rows = 0
        self._started = PERF()

    def add(self, part: str, seconds: float) -> None:
        self._parts[part] += seconds

    def decode_step(self, build: float, launch: float, wait: float) -> None:
        """A solo sequence's decode step, its three parts timed apart."""
        parts = self._parts
        parts["graph_build"] += build
        parts["launch"] += launch
        parts["device_wait"] += wait

    def decoded_rows(self, rows: int, verified: bool = False) -> None:
        """This loop decoded `rows` sequences in one step (a solo step: 1); `verified`: drafts among them."""
        self._rows += rows
        if verified:
            self._verify_rows += rows

    def begin_batch_step(self) -> None:
        self._built_at, self._step_tic = self._parts["graph_build"], PERF()

    def end_batch_step(self) -> None:
        """A `BatchGenerator` step is over: what its forward passes did not take was launching
        the step and waiting for the device (mlx-lm does both inside the one call)."""
        built = self._parts["graph_build"] - self._built_at
        self._parts["device_wait"] += max(0.0, PERF() - self._step_tic - built)

    def prefilled(self) -> None:
        """This loop fed prompt tokens: its time is not a decode step's."""
        self._prefilled = True

    def end_loop(self, tokens: int) -> None:
        """The loop made `tokens` (0: nothing to count)."""
        if not tokens or self._prefilled:
            return
        wall = PERF() - self._started
        parts = {**self._parts, "host": max(0.0, wall - sum(self._parts.values()))}
        for totals in (self.totals, self.verify_totals) if self._verify_rows else (self.totals,):
            for name, seconds in parts.items():
                totals[name] += seconds
        self.loops += 1
        self.tokens += tokens
        self.rows += self._rows
        self.verify_rows += self._verify_rows
        self.verify_loops += self._verify_rows > 0

    def snapshot(self) -> dict[str, Any]:
        """The totals and both threads' CPU seconds so far (the caller's thread is taken for the
        event loop's: call it from the loop)."""
        cpu = _thread_cpu_seconds()
        return {
            "loops": self.loops,
            "tokens": self.tokens,
            "rows": self.rows,
            "verify_loops": self.verify_loops,
            "verify_rows": self.verify_rows,
            **{f"{name}_s": round(seconds, 6) for name, seconds in self.totals.items()},
            **{f"verify_{name}_s": round(seconds, 6) for name, seconds in self.verify_totals.items()},
            "engine_cpu_s": cpu.get(self.engine_tid) if self.engine_tid is not None else None,
            "event_loop_cpu_s": cpu.get(threading.get_native_id()),
        }


class TimedForward:
    """The model (`model_of()`: the runner's current one) as `BatchGenerator` calls it: each
    forward pass (graph building; nothing runs yet) is added to `clock`'s graph-build time."""

    def __init__(self, model_of: Callable[[], Any], clock: StepClock) -> None:
        self._model_of = model_of
        self._clock = clock

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tic = PERF()
        out = self._model_of()(*args, **kwargs)
        self._clock.add("graph_build", PERF() - tic)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model_of(), name)


def _thread_cpu_seconds() -> dict[int, float]:
    try:
        return {t.id: t.user_time + t.system_time for t in psutil.Process().threads()}
    except (psutil.Error, OSError):  # not permitted here: no CPU times
        return {}
