"""One plan being carried out (`Loading`): what was started ahead of the request's insert (SSD
reads on reader threads, RAM moves a chunk per engine loop) and what they brought. The scheduler
holds it while the request is RESTORING; only the loader changes it, on the engine thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omlx.cache.plan.read_watch import ReadWatch
from omlx.cache.plan.restore_plan import RestorePlan, Tier

if TYPE_CHECKING:  # no MLX where the scheduler reads it
    from omlx.cache.block.block import CacheBlock


@dataclass(eq=False)
class Loading:
    """`plan` and its work ahead: `reads` of its SSD run (futures of `TimedRead`, in run order) judged
    again by `watch` as they finish; `to_move`, the RAM run's blocks still to move (root first) and
    `moved`, those moved (key -> block in device memory)."""

    plan: RestorePlan
    reads: list[Future[Any]] = field(default_factory=list)
    watch: ReadWatch | None = None
    to_move: list[str] = field(default_factory=list)
    moved: dict[str, CacheBlock] = field(default_factory=dict)
    moving_s: float = 0.0  # seconds spent moving, and from the first move (the debug line)
    first_move: float | None = None
    loops: int = 0
    # what `cache_for` restored, for the request's report (`why.Outcome`): (tier, tokens, bytes) per block in
    # chain order, and whether a stateful chain lost its last block's state
    parts: list[tuple[Tier, int, int]] = field(default_factory=list)
    lost_state: bool = False
    probed_slower: bool = False  # a probe of a tier showed the rest of its run slower than recomputing
    seconds: dict[Tier, float] = field(default_factory=dict)  # the restore's time per slower tier (RAM, SSD)
    report: Any = None  # `why.CacheReport`, left by `cache_for`

    @property
    def needs_engine(self) -> bool:
        """Whether the loader has moves to make on the engine thread (else only reads to wait for)."""
        return bool(self.to_move)

    @property
    def pending(self) -> bool:
        """Whether something was started ahead: the request waits (RESTORING) until `advance` says ready."""
        return bool(self.reads or self.to_move)

    @property
    def cut(self) -> bool:
        """The SSD reads were cut short, the rest judged slower than recomputing."""
        return self.watch is not None and self.watch.cut


def when_all_done(futures: list[Future[Any]], on_done: Callable[[], None]) -> None:
    """Call `on_done` (on the thread that finishes it) once the last of `futures` is done."""
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Any) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            on_done()

    for future in futures:
        future.add_done_callback(one_done)
