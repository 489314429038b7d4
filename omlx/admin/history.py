"""The dashboard's charts over time: every `INTERVAL_S` the server adds a point of what happened
since the previous one (requests, tokens, TTFT p50/p95, cache hits and misses per tier) and the
memory held then (per cache tier, models, process). Points are kept `RETENTION_S` and saved in
`$OMLX_HOME/history.json` every minute and at stop, so the charts survive restarts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

import psutil

from omlx.admin.metrics import RequestMetrics

log = logging.getLogger("omlx.admin")

INTERVAL_S = 10
RETENTION_S = 24 * 3600
SAVE_EVERY = 6  # samples between saves
TIERS = {"hot": "hot", "warm": "ram", "ssd": "ssd"}  # cache stats' key -> the name in a point
FILE_NAME = "history.json"


def percentile(values: list[float], q: float) -> float | None:
    """The `q` quantile (0..1) of `values`, interpolated; None when empty."""
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


class History:
    """Points of the server's activity; `sample` on the event loop (no MLX call)."""

    def __init__(self, metrics: RequestMetrics, pool: Any, cache: Any, path: Path, rss: Any = None):
        self.metrics = metrics
        self.pool = pool
        self.cache = cache
        self.path = path
        self._rss = rss or (lambda: psutil.Process().memory_info().rss)
        self.points: list[dict[str, Any]] = self._load()
        self._last_t = time.time()
        self._last = self._totals()  # the counters at start (zero, bar what ran before sampling)
        self._task: asyncio.Task | None = None

    def _load(self) -> list[dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            log.warning("ignoring %s (%s): the charts start empty", self.path, exc)
            return []
        points = data.get("points") if isinstance(data, dict) else None
        cutoff = time.time() - RETENTION_S
        return [p for p in points if isinstance(p, dict) and p.get("t", 0) > cutoff] if isinstance(points, list) else []

    def save(self) -> None:
        try:
            tmp = self.path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps({"interval_s": INTERVAL_S, "points": self.points}, separators=(",", ":")))
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("could not save the charts' history to %s: %s", self.path, exc)

    def _totals(self) -> dict[str, Any]:
        series = self.metrics.series()
        stats = self.cache.stats() if self.cache is not None else {}
        return {
            "requests": sum(sum(s.finished.values()) for s in series.values()),
            "prompt_tokens": sum(s.prompt_tokens for s in series.values()),
            "generation_tokens": sum(s.completion_tokens for s in series.values()),
            "hits": {name: (stats.get(key) or {}).get("hits", 0) for key, name in TIERS.items()},
            "misses": {name: (stats.get(key) or {}).get("misses", 0) for key, name in TIERS.items()},
            "bytes": {name: (stats.get(key) or {}).get("bytes", 0) for key, name in TIERS.items()},
        }

    def _point(self, now: float, totals: dict[str, Any]) -> dict[str, Any]:
        """What happened between the last sample and `now`, and the memory at `now`."""
        last = self._last
        ttfts = self.metrics.ttfts_since(self._last_t)
        return {
            "t": round(now, 3),
            "dt": round(now - self._last_t, 3),
            "requests": totals["requests"] - last["requests"],
            "prompt_tokens": totals["prompt_tokens"] - last["prompt_tokens"],
            "generation_tokens": totals["generation_tokens"] - last["generation_tokens"],
            "ttft_count": len(ttfts),
            "ttft_p50": percentile(ttfts, 0.5),
            "ttft_p95": percentile(ttfts, 0.95),
            "hits": {t: totals["hits"][t] - last["hits"][t] for t in totals["hits"]},
            "misses": {t: totals["misses"][t] - last["misses"][t] for t in totals["misses"]},
            "bytes": {
                **totals["bytes"],
                "models": sum(e.memory for e in list(self.pool.entries.values())),
                "process": self._rss(),
            },
        }

    def sample(self, now: float | None = None) -> dict[str, Any]:
        """Add the point since the last sample."""
        now = time.time() if now is None else now
        totals = self._totals()
        point = self._point(now, totals)
        self._last, self._last_t = totals, now
        self.points.append(point)
        cutoff = now - RETENTION_S
        while self.points and self.points[0]["t"] <= cutoff:
            self.points.pop(0)
        return point

    def view(self) -> dict[str, Any]:
        """The kept points and a live one since the last sample (not kept)."""
        live = {**self._point(time.time(), self._totals()), "live": True}
        return {"interval_s": INTERVAL_S, "retention_s": RETENTION_S, "kept_across_restarts": True,
                "points": [*self.points, live]}

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        n = 0
        while True:
            await asyncio.sleep(INTERVAL_S)
            self.sample()
            n += 1
            if n % SAVE_EVERY == 0:
                await asyncio.to_thread(self.save)

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.sample()
        self.save()
