"""Attention graphs built before long prompts need them, while an engine is idle (CUDA).

MLX's CUDA backend builds a cuDNN graph for each attention shape the first time it meets it.
A lone prompt is prefilled in chunks that end on multiples of the engine's solo step, so every
long prompt meets the same (step, step * j) shapes: an idle engine feeds a dummy prompt
through the model in those very chunks, once, and drops its KV cache after
(docs/design/graph-warmup.md).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from omlx.engine.solo import PrefillShapes

log = logging.getLogger("omlx.engine")

# About this share of the device's memory holds the dummy prompt's KV cache: on a smaller GPU
# it stops short of the depth.
MEMORY_FRACTION = 0.05
# Interrupted this many times by requests, it gives up: a server that busy builds the graphs
# with its users' prompts anyway.
MAX_RESTARTS = 8


class GraphWarmup:
    """A dummy prompt of `depth` tokens, fed one `step`-sized chunk per `feed` call while no
    engine of the process has requests; `pause` drops its cache, and the next idle spell
    starts it over (docs/design/graph-warmup.md)."""

    def __init__(
        self, model: Any, depth: int, step: int, token: int, memory_budget: int, shapes: PrefillShapes | None = None
    ) -> None:
        self.model = model
        self.shapes = shapes  # where the chunks' shapes are recorded, if anywhere
        self.depth = depth - depth % step  # whole chunks: a partial one's shape is nobody's
        self.step = step
        self.token = token
        self.memory_budget = memory_budget
        self.fed = 0
        self.seconds = 0.0  # spent feeding (not waiting between chunks)
        self.pauses = 0  # times requests interrupted it
        self.error: str | None = None  # why it stopped short (it failed, or gave up)
        self._cache: list[Any] | None = None

    @property
    def done(self) -> bool:
        return self.fed >= self.depth

    @property
    def over(self) -> bool:
        """Done, failed or given up: the engine can forget it."""
        return self.done or self.error is not None

    def progress(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": self.fed, "target": self.depth, "done": self.done}
        if self.error is not None:
            out["error"] = self.error
        return out

    def pause(self) -> None:
        """Requests came: drop what was fed (counted once per interruption)."""
        if self._cache is None:
            return
        self._cache = None
        self.fed = 0
        self.pauses += 1
        if self.pauses >= MAX_RESTARTS:
            self.error = f"gave up after {self.pauses} interruptions by requests"

    def feed(self) -> None:
        """One chunk through the model (blocking: the engine has nothing else to do)."""
        if self.over:
            return
        tic = time.perf_counter()
        if self._cache is None:
            self._cache = make_prompt_cache(self.model)
        n = min(self.step, self.depth - self.fed)
        # as `SoloSequence.feed_chunk` calls it; only the cache is evaluated, never the logits
        self.model(mx.array([self.token] * n)[None], cache=self._cache)
        mx.eval([c.state for c in self._cache])
        if self.shapes is not None:
            self.shapes.add(1, n, self.fed + n)
        self.fed += n
        if self.fed == n:  # the first chunk tells what a token's keys and values take
            per_token = sum(_nbytes(c.state) for c in self._cache) / n
            affordable = int(self.memory_budget // max(per_token, 1))
            self.depth = max(n, min(self.depth, affordable - affordable % self.step))
        self.seconds += time.perf_counter() - tic
        if self.done:
            self._cache = None

    @classmethod
    def for_model(
        cls, model: Any, tokenizer: Any, eos_ids: list[int], depth: int, step: int, shapes: PrefillShapes | None
    ) -> GraphWarmup | None:
        """A warm-up `depth` tokens deep in chunks of `step` (None: not even one chunk)."""
        if depth < step:
            return None
        from omlx.cache.setup import hot_tier_total_bytes  # the device's memory

        token = next((t for t in tokenizer.encode("warm up") if t not in eos_ids), 0)
        return cls(model, depth, step, token, int(hot_tier_total_bytes() * MEMORY_FRACTION), shapes)

    def log_end(self, model_id: str) -> None:
        """Its one log line once `over`."""
        if self.done:
            log.info(
                "built the attention graphs of %s for prompts up to %d tokens in %.2fs (%d chunks, started over %d times after requests)",
                model_id, self.depth, self.seconds, self.depth // self.step, self.pauses,
            )  # fmt: skip
        elif self.pauses >= MAX_RESTARTS:
            log.info("attention-graph warm-up of %s: %s", model_id, self.error)

    def close(self, reason: str) -> None:
        """Stop for good (it failed, or its engine stops), dropping the dummy cache."""
        self._cache = None
        if not self.done and self.error is None:
            self.error = reason


def _nbytes(state: Any) -> int:
    if isinstance(state, mx.array):
        return int(state.nbytes)
    if isinstance(state, (list, tuple)):
        return sum(_nbytes(s) for s in state)
    return 0
