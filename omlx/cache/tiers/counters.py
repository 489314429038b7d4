"""Process-wide counters of the prefix cache for `GET /api/cache/stats`: requests and the tokens
served from the cache, and the device -> host copies made on engine threads."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CacheCounters:
    """Request-level counters (the tiers count their own blocks); any thread, under `lock`."""

    requests: int = 0
    hits: int = 0
    misses: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    skipped_restores: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, prompt_tokens: int, cached_tokens: int) -> None:
        """One request's prompt and the tokens of it served from the cache."""
        with self.lock:
            self.requests += 1
            self.prompt_tokens += prompt_tokens
            self.hit_tokens += cached_tokens
            if cached_tokens:
                self.hits += 1
            else:
                self.misses += 1

    def skipped(self) -> None:
        """A restore judged slower than recomputing."""
        with self.lock:
            self.skipped_restores += 1

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "requests": self.requests,
                "hits": self.hits,
                "misses": self.misses,
                "prompt_tokens": self.prompt_tokens,
                "hit_tokens": self.hit_tokens,
                "hit_rate": (self.hit_tokens / self.prompt_tokens) if self.prompt_tokens else 0.0,
                "skipped_restores": self.skipped_restores,
            }


class CopyCounts:
    """Device -> host copies of blocks made on engine threads, by why: `evicted` (let go past what
    may wait, copied at once), `demoted` (waited, copied later) and `handed` (to the SSD writer
    from device memory); bytes and seconds of each, for `stats`."""

    KINDS = ("evicted", "demoted", "handed")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {kind: [0, 0.0] for kind in self.KINDS}

    def add(self, kind: str, nbytes: int, since: float) -> None:
        """One copy of `nbytes` that began at `since` (`time.perf_counter`)."""
        seconds = time.perf_counter() - since
        with self._lock:
            entry = self._counts[kind]
            entry[0] += nbytes
            entry[1] += seconds

    def snapshot(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {kind: {"bytes": n, "seconds": round(s, 4)} for kind, (n, s) in self._counts.items()}
