"""The process memory guard (`--max-process-memory`) through a real server: with a limit just
under what the process holds, the test watches each action happen in turn (an idle model
unloaded, a load refused, the hot tier shrunk, requests refused with 503 and Retry-After in
each dialect) and the resident memory stay within the limit plus a margin."""

from __future__ import annotations

import shutil
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.server import ServerProcess
from tests.support.tiny_model import build_tiny_llama

MiB = 1 << 20
# The guard checks every 0.5 s; between two checks the requests running may add their KV and the
# Python heap its garbage: the margin over the limit this test allows.
MARGIN = 64 * MiB


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    models = tmp_path_factory.mktemp("guard-models")
    build_tiny_llama(models / "big", hidden=768, layers=8, heads=12, kv_heads=4)  # ~160 MB of float32
    build_tiny_llama(models / "small")
    home = tmp_path_factory.mktemp("guard-home")
    srv = ServerProcess(home, ["--model-dir", str(models)])
    srv.start()
    yield srv
    srv.stop()
    shutil.rmtree(home, ignore_errors=True)


def metrics(server: ServerProcess) -> dict[tuple[str, tuple], float]:
    text = httpx.get(server.base_url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def rss(server: ServerProcess) -> int:
    return int(metrics(server)[("omlx_process_memory_bytes", ())])


def action(server: ServerProcess, name: str) -> float:
    return metrics(server)[("omlx_memory_guard_actions_total", (("action", name),))]


def chat(server: ServerProcess, model: str) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "memory " * 300}], "max_tokens": 2})


def set_limit(server: ServerProcess, value: int | str) -> None:
    r = httpx.put(server.base_url + "/api/settings", json={"max_process_memory": str(value)})
    assert r.status_code == 200, r.text


def states(server: ServerProcess) -> dict[str, str]:
    return {m["id"]: m["state"] for m in httpx.get(server.base_url + "/v1/models/status").json()["data"]}


def wait_for(condition, timeout: float = 20.0, server=None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        time.sleep(0.2)
    guard_lines = [line for line in server.log().splitlines() if "memory" in line] if server else []
    raise AssertionError("the guard did not act in time:\n" + "\n".join(guard_lines[-20:]))


def test_the_guard_unloads_refuses_loads_shrinks_tiers_then_refuses_requests(server):
    assert chat(server, "big").status_code == 200
    assert chat(server, "small").status_code == 200  # big is now the least recently used
    hot_budget = httpx.get(server.base_url + "/api/cache/stats").json()["hot"]["max_bytes"]
    limit = rss(server) - 64 * MiB
    set_limit(server, limit)

    # 1. the idle model least recently used goes, and its memory with it
    wait_for(lambda: states(server)["big"] == "unloaded" and rss(server) <= limit, server=server)
    assert states(server)["small"] == "loaded" and action(server, "unload") == 1
    assert metrics(server)[("omlx_model_unloads_total", (("model", "big"), ("reason", "memory")))] == 1

    # 2. a load that would cross the limit is refused (small, idle, could not make room for it),
    # and the process stays within the limit: no work was let in to grow it
    r = chat(server, "big")
    assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
    assert r.json()["error"]["code"] == "memory_limit" and "--max-process-memory" in r.json()["error"]["message"]
    assert states(server) == {"big": "unloaded", "small": "loaded"}
    assert chat(server, "small").status_code == 200  # under the limit, requests are served
    assert rss(server) <= limit + MARGIN

    # 3. a limit nothing can meet, with nothing idle to unload (small is pinned): the hot tier
    # gives up its blocks, then requests are refused in their own dialect
    httpx.put(server.base_url + "/api/models/small/settings", json={"pinned": True})
    assert httpx.get(server.base_url + "/api/cache/stats").json()["hot"]["bytes"] > 0
    set_limit(server, 128 * MiB)
    wait_for(lambda: metrics(server)[("omlx_memory_guard_over", ())] == 1, server=server)
    hot = httpx.get(server.base_url + "/api/cache/stats").json()["hot"]
    assert hot["max_bytes"] == 0 and hot["bytes"] == 0
    assert action(server, "shrink") >= 1 and action(server, "clear") >= 2 and action(server, "unload") == 1
    r = chat(server, "small")
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"]["type"] == "server_error"
    r = httpx.post(server.base_url + "/v1/messages", timeout=60, json={
        "model": "small", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "overloaded_error"
    assert action(server, "refuse") >= 3

    # 4. no limit: the tier's budget comes back and requests are served
    set_limit(server, 0)
    wait_for(lambda: httpx.get(server.base_url + "/api/cache/stats").json()["hot"]["max_bytes"] == hot_budget,
             server=server)
    assert chat(server, "small").status_code == 200
