"""The charts' history: points of what happened between samples, saved and read back at the
next start, older ones than the retention dropped."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

from omlx.admin.history import RETENTION_S, History
from omlx.admin.metrics import RequestMetrics


def finished(metrics: RequestMetrics, prompt: int, completion: int, ttft: float) -> None:
    metrics.record("m", {"request_id": "chatcmpl-1", "finish_reason": "stop", "prompt_tokens": prompt,
                         "cached_tokens": 0, "completion_tokens": completion, "ttft_s": ttft, "e2e_s": ttft})


def test_points_hold_what_happened_since_the_last_and_survive_a_restart(tmp_path):
    path = tmp_path / "history.json"
    pool = SimpleNamespace(entries={})
    metrics = RequestMetrics()
    history = History(metrics, pool, None, path, rss=lambda: 123)
    finished(metrics, 100, 5, 0.2)
    finished(metrics, 50, 3, 0.4)
    first = history.sample()
    finished(metrics, 10, 1, 1.0)
    second = history.sample()
    assert (first["requests"], first["prompt_tokens"], first["generation_tokens"]) == (2, 150, 8)
    assert first["ttft_count"] == 2 and abs(first["ttft_p50"] - 0.3) < 1e-9
    assert (second["requests"], second["ttft_p95"], second["bytes"]["process"]) == (1, 1.0, 123)
    history.stop()  # a last point, then saved

    again = History(RequestMetrics(), pool, None, path, rss=lambda: 1)
    assert [p["requests"] for p in again.points] == [2, 1, 0]
    view = again.view()
    assert view["points"][-1]["live"] and view["kept_across_restarts"]

    old = json.loads(path.read_text())
    old["points"][0]["t"] = time.time() - RETENTION_S - 1
    path.write_text(json.dumps(old))
    assert [p["requests"] for p in History(RequestMetrics(), pool, None, path).points] == [1, 0]
