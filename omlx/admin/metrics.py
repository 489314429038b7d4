"""Request and token counters for the dashboard, fed by every LLM engine as requests finish."""

from __future__ import annotations

import threading
from typing import Any


class RequestMetrics:
    """Totals since start, overall and per model. `record` runs on engine threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = self._empty()
        self._models: dict[str, dict[str, Any]] = {}

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
        with self._lock:
            for bucket in (self._total, self._models.setdefault(model_id, self._empty())):
                bucket["requests"] += 1
                reason = str(result.get("finish_reason"))
                bucket["finished"][reason] = bucket["finished"].get(reason, 0) + 1
                bucket["prompt_tokens"] += int(result.get("prompt_tokens", 0))
                bucket["cached_tokens"] += int(result.get("cached_tokens", 0))
                bucket["completion_tokens"] += int(result.get("completion_tokens", 0))
                bucket["ttft_s_sum"] += float(result.get("ttft_s", 0.0))
                if result.get("decode_tps"):
                    bucket["last_decode_tps"] = float(result["decode_tps"])

    def snapshot(self) -> dict[str, Any]:
        def view(b: dict[str, Any]) -> dict[str, Any]:
            out = {k: v for k, v in b.items() if k != "ttft_s_sum"}
            out["finished"] = dict(b["finished"])
            out["avg_ttft_s"] = b["ttft_s_sum"] / b["requests"] if b["requests"] else None
            return out

        with self._lock:
            return {**view(self._total), "models": {m: view(b) for m, b in sorted(self._models.items())}}
