"""Attention graphs built before long prompts need them, while an engine is idle (CUDA).

MLX's CUDA backend builds a cuDNN graph for each attention shape (query length, key length)
the first time it meets it: 39-46 ms on an H200, against 1 ms for a hit
(`benchmarks/gpu/sdpa_cache_probe.py`). A lone prompt is prefilled in chunks that end on
multiples of the engine's solo step (2,048 tokens there), so every long prompt meets the same
(2048, 2048 * j) shapes; yet the first 32,000-token prompt after a start paid ~15 builds:
0.9-1.25 s against 0.33 s once warm. An idle engine therefore feeds a dummy prompt through
the model in those very chunks, once, and drops its KV cache after.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

log = logging.getLogger("omlx.engine")

# At most this share of the device's memory holds the dummy prompt's KV cache (1 GB at 32,000
# tokens for a 1B Llama, 4.2 GB for an 8B one): on a smaller GPU it stops short of the depth.
MEMORY_FRACTION = 0.05


class GraphWarmup:
    """A dummy prompt of `depth` tokens, fed one `step`-sized chunk per `feed` call.

    The engine calls `feed` only while no request waits, so a request that arrives meets at
    most one chunk in its way; the cache stays between calls, so the warm-up resumes where
    it paused rather than starting over."""

    def __init__(self, model: Any, depth: int, step: int, token: int, memory_budget: int) -> None:
        self.model = model
        self.depth = depth - depth % step  # whole chunks: a partial one's shape is nobody's
        self.step = step
        self.token = token
        self.memory_budget = memory_budget
        self.fed = 0
        self.seconds = 0.0  # spent feeding (not waiting between chunks)
        self.pauses = 0  # times requests came before it was done
        self._paused = False
        self._cache: list[Any] | None = None

    @property
    def done(self) -> bool:
        return self.fed >= self.depth

    def progress(self) -> dict[str, Any]:
        return {"tokens": self.fed, "target": self.depth, "done": self.done}

    def pause(self) -> None:
        """The engine has requests: no chunk now (counted once per pause, for the log)."""
        if self.fed and not self._paused:
            self.pauses += 1
            self._paused = True

    def feed(self) -> None:
        """One chunk through the model (blocking: the engine has nothing else to do)."""
        if self.done:
            return
        self._paused = False
        tic = time.perf_counter()
        if self._cache is None:
            self._cache = make_prompt_cache(self.model)
        n = min(self.step, self.depth - self.fed)
        # as `SoloSequence.feed_chunk` calls it; only the cache is evaluated, never the logits
        self.model(mx.array([self.token] * n)[None], cache=self._cache)
        mx.eval([c.state for c in self._cache])
        self.fed += n
        if self.fed == n:  # the first chunk tells what a token's keys and values take
            per_token = sum(_nbytes(c.state) for c in self._cache) / n
            affordable = int(self.memory_budget // max(per_token, 1))
            self.depth = max(n, min(self.depth, affordable - affordable % self.step))
        self.seconds += time.perf_counter() - tic
        if self.done:
            self._cache = None

    def close(self) -> None:
        """Drop the dummy prompt's cache (an engine that stops or fails)."""
        self._cache = None


def _nbytes(state: Any) -> int:
    if isinstance(state, mx.array):
        return int(state.nbytes)
    if isinstance(state, (list, tuple)):
        return sum(_nbytes(s) for s in state)
    return 0
