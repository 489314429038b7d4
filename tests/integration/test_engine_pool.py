"""Multi-model serving through a real server: LRU eviction, pinning, busy models, TTL, profiles."""

from __future__ import annotations

import concurrent.futures as cf
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.server import ServerProcess
from tests.support.tiny_model import build_tiny_llama

MODELS = ["model-a", "model-b", "model-c"]


@pytest.fixture(scope="module")
def three_models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("three")
    for i, name in enumerate(MODELS):
        build_tiny_llama(root / name, seed=i)
    return root


def model_bytes(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in (model_dir / "model-a").glob("*.safetensors"))


@pytest.fixture()
def server(three_models, tmp_path):
    """Room for two of the three models."""
    limit = int(model_bytes(three_models) * 2.5)
    s = ServerProcess(tmp_path / "home", ["--model-dir", str(three_models), "--max-model-memory", str(limit)])
    s.start()
    yield s
    s.stop()


def chat(server, model: str, max_tokens: int | None = 3, **extra) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "temperature": 0, **extra}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)


def states(server) -> dict[str, str]:
    data = httpx.get(server.base_url + "/v1/models/status").json()["data"]
    return {m["id"]: m["state"] for m in data}


def test_lru_eviction_order_and_explicit_load_unload(server):
    assert chat(server, "model-a").status_code == 200
    assert chat(server, "model-b").status_code == 200
    assert chat(server, "model-a").status_code == 200  # a is now more recent than b
    assert chat(server, "model-c").status_code == 200
    assert states(server) == {"model-a": "loaded", "model-b": "unloaded", "model-c": "loaded"}
    r = httpx.post(server.base_url + "/v1/models/model-c/unload")
    assert r.json()["unloaded"] is True
    r = httpx.post(server.base_url + "/v1/models/model-b/load")
    assert r.status_code == 200 and r.json()["state"] == "loaded"
    status = {m["id"]: m for m in httpx.get(server.base_url + "/v1/models/status").json()["data"]}
    assert status["model-b"]["memory_bytes"] > 0 and status["model-b"]["last_used"]
    assert status["model-c"]["state"] == "unloaded"


def test_pinned_model_survives_eviction_and_over_limit_is_507(server):
    url = server.base_url + "/api/models/{}/settings"
    assert httpx.put(url.format("model-a"), json={"pinned": True}).json()["settings"]["pinned"] is True
    assert chat(server, "model-a").status_code == 200
    assert chat(server, "model-b").status_code == 200
    assert chat(server, "model-c").status_code == 200  # b (unpinned) goes, a stays
    assert states(server)["model-a"] == "loaded" and states(server)["model-b"] == "unloaded"
    httpx.put(url.format("model-c"), json={"pinned": True})
    r = chat(server, "model-b")
    assert r.status_code == 507
    msg = r.json()["error"]["message"]
    assert "model-b" in msg and "--max-model-memory" in msg


def test_busy_model_is_not_evicted_and_its_stream_continues(server):
    assert chat(server, "model-a").status_code == 200
    body = {"model": "model-a", "messages": [{"role": "user", "content": "long"}], "max_tokens": 400,
            "temperature": 0, "stream": True, "logit_bias": {"2": -100},
            "stream_options": {"include_usage": True}}
    chunks: list[str] = []
    started = threading.Event()

    def stream():
        with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line)
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(30)
    assert chat(server, "model-b").status_code == 200
    r = chat(server, "model-c")  # a is busy: b (idle) is evicted instead
    assert r.status_code == 200
    t.join(120)
    assert chunks[-1] == "data: [DONE]"
    assert '"completion_tokens":400' in chunks[-2]
    assert states(server)["model-b"] == "unloaded"


def test_ttl_unloads_idle_model_but_not_pinned(server):
    httpx.put(server.base_url + "/api/models/model-a/settings", json={"ttl": 1})
    httpx.put(server.base_url + "/api/models/model-b/settings", json={"ttl": 1, "pinned": True})
    chat(server, "model-a")
    chat(server, "model-b")
    deadline = time.time() + 15
    while states(server)["model-a"] != "unloaded" and time.time() < deadline:
        time.sleep(0.3)
    assert states(server)["model-a"] == "unloaded"
    assert states(server)["model-b"] == "loaded"


def test_concurrent_first_requests_load_once(server):
    with cf.ThreadPoolExecutor(6) as ex:
        results = list(ex.map(lambda _: chat(server, "model-c").status_code, range(6)))
    assert results == [200] * 6
    assert server.log().count("loading model-c") == 1


def test_settings_and_profiles_shape_outputs(server):
    base = server.base_url + "/api/models/model-a"
    assert httpx.put(base + "/settings", json={"max_tokens": 5, "aliases": ["claude-*"]}).status_code == 200
    r = chat(server, "model-a", max_tokens=None).json()
    assert r["usage"]["completion_tokens"] == 5 or r["choices"][0]["finish_reason"] == "stop"
    assert httpx.post(base + "/profiles/short", json={"max_tokens": 2}).status_code == 200
    assert httpx.post(base + "/profiles/short", json={"max_tokens": 2}).status_code == 400  # exists
    r = chat(server, "model-a:short", max_tokens=None, logit_bias={"2": -100}).json()
    assert r["usage"]["completion_tokens"] == 2
    r = chat(server, "model-a:short", max_tokens=4, logit_bias={"2": -100}).json()
    assert r["usage"]["completion_tokens"] == 4  # the request wins over the profile
    r = chat(server, "claude-sonnet-4-5", max_tokens=None, logit_bias={"2": -100}).json()
    assert r["usage"]["completion_tokens"] == 5  # alias → model-a with its settings
    assert httpx.put(base + "/profiles/short", json={"max_tokens": 3}).status_code == 200
    assert chat(server, "model-a:short", max_tokens=None, logit_bias={"2": -100}).json()["usage"]["completion_tokens"] == 3
    assert httpx.delete(base + "/profiles/short").status_code == 200
    assert chat(server, "model-a:short").status_code == 404
    bad = httpx.put(base + "/settings", json={"temperature": 9})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    saved = (server.home / "model_settings.json").read_text()
    assert '"model-a"' in saved and "claude-*" in saved


def test_refresh_picks_up_new_and_removed_folders(server, three_models):
    extra = three_models / "model-d"
    shutil.copytree(three_models / "model-a", extra)
    try:
        r = httpx.post(server.base_url + "/api/models/refresh").json()
        assert "model-d" in r["models"]
    finally:
        shutil.rmtree(extra)
    r = httpx.post(server.base_url + "/api/models/refresh").json()
    assert "model-d" not in r["models"]
    assert chat(server, "model-d").status_code == 404


def test_status_splits_decode_time_per_part(server):
    """`step_times` accounts the decode loops of a lone sequence and of a batch: every part is
    counted, and the parts of the engine's loops add up within the wall time they took."""

    def step_times() -> dict:
        data = httpx.get(server.base_url + "/v1/models/status").json()["data"]
        return next(m for m in data if m["id"] == "model-a")["step_times"]

    lone = dict(max_tokens=40, logit_bias={"2": -100})
    tic = time.perf_counter()
    assert chat(server, "model-a", **lone).status_code == 200
    after_one = step_times()
    with cf.ThreadPoolExecutor(4) as pool:
        assert all(r.status_code == 200 for r in pool.map(lambda _: chat(server, "model-a", **lone), range(4)))
    wall = time.perf_counter() - tic
    after_batch = step_times()
    assert after_one["tokens"] >= 30 and after_one["loops"] >= 30
    for part in ("graph_build_s", "launch_s", "device_wait_s", "host_s"):
        assert after_one[part] > 0, part  # the lone sequence decodes on the solo path
    assert after_batch["tokens"] - after_one["tokens"] >= 100
    assert after_batch["loops"] - after_one["loops"] < after_batch["tokens"] - after_one["tokens"]  # batched
    assert after_batch["graph_build_s"] > after_one["graph_build_s"]
    assert after_batch["device_wait_s"] > after_one["device_wait_s"]
    assert after_batch["cache_s"] > 0  # the prompts' stores and the write-back run between steps
    parts = sum(after_batch[p] for p in ("graph_build_s", "launch_s", "device_wait_s", "cache_s", "host_s"))
    assert parts < wall
    assert after_batch["engine_cpu_s"] > 0 and after_batch["event_loop_cpu_s"] > 0


def test_a_restart_loads_what_was_loaded_at_stop_and_the_pinned_models(server, three_models):
    assert set(states(server).values()) == {"unloaded"}  # a new home loads nothing it was not asked for
    assert chat(server, "model-a").status_code == 200
    assert chat(server, "model-b").status_code == 200
    assert httpx.post(server.base_url + "/v1/models/model-b/unload").json()["unloaded"] is True
    httpx.put(server.base_url + "/api/models/model-c/settings", json={"pinned": True})
    server.stop()
    again = ServerProcess(server.home, server.args)
    again.start()  # healthy only once its start's models are loaded
    try:
        assert states(again) == {"model-a": "loaded", "model-b": "unloaded", "model-c": "loaded"}
    finally:
        again.stop()
