"""Request and token counters and latency histograms, fed by every LLM engine as requests
finish: the one accumulator behind the dashboard's counters, `/metrics` and the history."""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

# Bucket bounds in seconds: vLLM's, with finer ones below 10 ms for inter-token gaps on a GPU.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
HISTOGRAMS = {"ttft": TTFT_BUCKETS, "itl": ITL_BUCKETS, "e2e": LATENCY_BUCKETS, "queue": LATENCY_BUCKETS}
RECENT_TTFTS = 8192  # (finish time, TTFT) of the latest requests, for the history's percentiles

# The API a request came through, read off its id's prefix (set by each route).
ENDPOINT_OF_PREFIX = {
    "chatcmpl": "chat_completions",
    "cmpl": "completions",
    "msg": "messages",
    "resp": "responses",
    "bench": "bench",
}


def endpoint_of(request_id: str) -> str:
    """`chat_completions`, `completions`, `messages`, `responses`, `bench` or `other`."""
    return ENDPOINT_OF_PREFIX.get(request_id.split("-", 1)[0], "other")


@dataclass
class Histogram:
    """Counts per bucket (not cumulative) plus one for +Inf, the sum and the count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def add(self, value: float, n: int = 1) -> None:
        """`n` observations of `value` (a request's n gaps between tokens, at their mean)."""
        if n <= 0:
            return
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n
        self.count += n

    def cumulative(self) -> list[tuple[str, int]]:
        """(upper bound, observations at or below it) as Prometheus writes them, +Inf last."""
        out, running = [], 0
        for bound, c in zip((*map(repr, self.bounds), "+Inf"), self.counts, strict=True):
            running += c
            out.append((bound, running))
        return out


@dataclass
class ModelSeries:
    """One model's totals: finished requests by (endpoint, reason), tokens, histograms."""

    finished: dict[tuple[str, str], int] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    drafted_tokens: int = 0  # speculative draft tokens verified, and accepted
    accepted_tokens: int = 0
    histograms: dict[str, Histogram] = field(
        default_factory=lambda: {name: Histogram(bounds) for name, bounds in HISTOGRAMS.items()}
    )
    restored: dict[str, list[float]] = field(default_factory=dict)  # tier -> [tokens, bytes, seconds] restored
    computed: dict[str, list[int]] = field(default_factory=dict)  # why not restored -> [requests, tokens]

    def add_cache(self, report: Any) -> None:
        """One request's `CacheReport`: tokens, bytes and seconds per tier, its computed tokens by reason."""
        for tier, share in report.tiers.items():
            entry = self.restored.setdefault(tier, [0, 0, 0.0])
            entry[0] += share.tokens
            entry[1] += share.bytes or 0
            entry[2] += share.seconds or 0.0
        entry = self.computed.setdefault(report.reason.value, [0, 0])
        entry[0] += 1
        entry[1] += report.computed


class RequestMetrics:
    """Totals since start, overall and per model. `record` runs on engine threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = self._empty()
        self._models: dict[str, dict[str, Any]] = {}
        self._series: dict[str, ModelSeries] = {}
        self._recent_ttfts: deque[tuple[float, float]] = deque(maxlen=RECENT_TTFTS)

    @staticmethod
    def _empty() -> dict[str, Any]:
        return {
            "requests": 0,
            "finished": {},
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "completion_tokens": 0,
            "ttft_s_sum": 0.0,
            "last_decode_tps": None,
        }

    def record(self, model_id: str, result: dict[str, Any]) -> None:
        reason = str(result.get("finish_reason"))
        prompt, cached = int(result.get("prompt_tokens", 0)), int(result.get("cached_tokens", 0))
        completion = int(result.get("completion_tokens", 0))
        ttft = float(result.get("ttft_s", 0.0))
        with self._lock:
            for bucket in (self._total, self._models.setdefault(model_id, self._empty())):
                bucket["requests"] += 1
                bucket["finished"][reason] = bucket["finished"].get(reason, 0) + 1
                bucket["prompt_tokens"] += prompt
                bucket["cached_tokens"] += cached
                bucket["completion_tokens"] += completion
                bucket["ttft_s_sum"] += ttft
                if result.get("decode_tps"):
                    bucket["last_decode_tps"] = float(result["decode_tps"])
            series = self._series.setdefault(model_id, ModelSeries())
            key = (endpoint_of(str(result.get("request_id", ""))), reason)
            series.finished[key] = series.finished.get(key, 0) + 1
            series.prompt_tokens += prompt
            series.cached_tokens += cached
            series.completion_tokens += completion
            series.drafted_tokens += int(result.get("drafted_tokens", 0))
            series.accepted_tokens += int(result.get("accepted_tokens", 0))
            if result.get("cache") is not None:
                series.add_cache(result["cache"])
            h = series.histograms
            if completion:  # a request that made no token had no first token
                h["ttft"].add(ttft)
                self._recent_ttfts.append((time.time(), ttft))
            if completion > 1 and result.get("decode_s"):
                h["itl"].add(float(result["decode_s"]) / (completion - 1), completion - 1)
            if "e2e_s" in result:
                h["e2e"].add(float(result["e2e_s"]))
            if "queue_s" in result:
                h["queue"].add(float(result["queue_s"]))

    def series(self) -> dict[str, ModelSeries]:
        """A copy of every model's series (for a scrape or a history sample)."""
        with self._lock:
            return {
                model: ModelSeries(
                    dict(s.finished), s.prompt_tokens, s.cached_tokens, s.completion_tokens,
                    s.drafted_tokens, s.accepted_tokens,
                    {n: Histogram(h.bounds, list(h.counts), h.sum, h.count) for n, h in s.histograms.items()},
                    {t: list(v) for t, v in s.restored.items()}, {r: list(v) for r, v in s.computed.items()},
                )
                for model, s in self._series.items()
            }

    def ttfts_since(self, since: float) -> list[float]:
        """TTFTs of the requests that finished after `since` (epoch seconds), of the latest kept."""
        with self._lock:
            return [ttft for t, ttft in self._recent_ttfts if t > since]

    def snapshot(self) -> dict[str, Any]:
        def view(b: dict[str, Any]) -> dict[str, Any]:
            out = {k: v for k, v in b.items() if k != "ttft_s_sum"}
            out["finished"] = dict(b["finished"])
            out["avg_ttft_s"] = b["ttft_s_sum"] / b["requests"] if b["requests"] else None
            return out

        with self._lock:
            return {**view(self._total), "models": {m: view(b) for m, b in sorted(self._models.items())}}
