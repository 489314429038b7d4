"""The admin JSON API through a real server: auth, sessions, sub-keys, settings, logs, system,
model files and benchmarks. Downloads have their own module."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.admin.conftest import API_KEY, login, start_server, writable_model_dir

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("admin-api")
    models = writable_model_dir(tiny_model_dir, root)
    srv = start_server(root / "home", models, "--api-key", API_KEY,
                       "--log-dir", str(root / "logs"), "--log-format", "json")
    srv.log_dir = root / "logs"
    yield srv
    srv.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture()
def admin(server) -> httpx.Client:
    client = login(server.base_url)
    yield client
    client.close()


def error_of(r: httpx.Response) -> dict:
    return r.json()["error"]


# ----- who may call what ---------------------------------------------------------------
ADMIN_ROUTES = [
    ("GET", "/api/status"), ("GET", "/api/system"), ("GET", "/api/settings"), ("PUT", "/api/settings"),
    ("GET", "/api/logs"), ("GET", "/api/keys"), ("POST", "/api/keys"), ("DELETE", "/api/keys/x"),
    ("GET", "/api/cache/stats"), ("POST", "/api/cache/explain"), ("DELETE", "/api/models/tiny-llama/files"),
    ("GET", "/api/hub/search"), ("GET", "/api/hub/models/a/b"), ("GET", "/api/downloads"),
    ("POST", "/api/downloads"), ("POST", "/api/downloads/x/cancel"), ("POST", "/api/downloads/x/retry"),
    ("DELETE", "/api/downloads/x"), ("GET", "/api/bench"), ("POST", "/api/bench"), ("POST", "/api/bench/cancel"),
]


@pytest.mark.parametrize("method,path", ADMIN_ROUTES)
def test_every_admin_route_requires_the_key_or_a_session(server, method, path):
    r = httpx.request(method, server.base_url + path, json={})
    assert r.status_code == 401, (path, r.text)
    assert "log in at /admin" in error_of(r)["message"]
    wrong = httpx.request(method, server.base_url + path, json={}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401


def test_the_api_key_opens_the_admin_api(server):
    r = httpx.get(server.base_url + "/api/system", headers=AUTH)
    assert r.status_code == 200
    body = r.json()
    assert body["auth_required"] is True
    assert {"device", "memory", "counters", "uptime_s"} <= set(body)
    assert httpx.get(server.base_url + "/api/system", headers={"x-api-key": API_KEY}).status_code == 200


def test_dashboard_page_and_health_need_no_key(server):
    page = httpx.get(server.base_url + "/admin")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert httpx.get(server.base_url + "/admin/static/core.js").status_code == 200
    assert httpx.get(server.base_url + "/health").status_code == 200
    session = httpx.get(server.base_url + "/api/auth/session").json()
    assert session == {"auth_required": True, "authenticated": False}


def test_login_sets_a_signed_httponly_strict_cookie(server):
    r = httpx.post(server.base_url + "/api/auth/login", json={"api_key": API_KEY})
    assert r.status_code == 200
    cookie = r.headers["set-cookie"]
    assert cookie.startswith("omlx_session=")
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
    assert API_KEY not in cookie
    token = cookie.split(";")[0].split("=", 1)[1]
    ok = httpx.get(server.base_url + "/api/system", cookies={"omlx_session": token})
    assert ok.status_code == 200
    forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    assert httpx.get(server.base_url + "/api/system", cookies={"omlx_session": forged}).status_code == 401


def test_login_with_a_wrong_or_missing_key_is_refused(server):
    r = httpx.post(server.base_url + "/api/auth/login", json={"api_key": "wrong"})
    assert r.status_code == 401 and "set-cookie" not in r.headers
    assert httpx.post(server.base_url + "/api/auth/login", json={}).status_code == 401
    assert httpx.post(server.base_url + "/api/auth/login", content=b"[1]").status_code == 400
    # A successful login clears the failure count, so later tests can log in.
    assert httpx.post(server.base_url + "/api/auth/login", json={"api_key": API_KEY}).status_code == 200


def test_session_state_changes_need_the_dashboard_header(server, admin):
    bare = httpx.Client(base_url=server.base_url, cookies=admin.cookies)
    r = bare.put("/api/settings", json={"default_max_tokens": 100})
    assert r.status_code == 403 and error_of(r)["code"] == "csrf"
    assert bare.get("/api/settings").status_code == 200  # reads need no header
    assert admin.put("/api/settings", json={"default_max_tokens": 100}).status_code == 200


def test_cross_origin_browser_requests_are_refused(server, admin):
    r = admin.put("/api/settings", json={"default_max_tokens": 100}, headers={"Origin": "http://evil.example"})
    assert r.status_code == 403 and error_of(r)["code"] == "cross_origin"
    r = httpx.put(server.base_url + "/api/settings", json={"default_max_tokens": 100},
                  headers={**AUTH, "Origin": "http://localhost:1"})
    assert r.status_code == 403
    same = admin.put("/api/settings", json={"default_max_tokens": 100},
                     headers={"Origin": server.base_url})
    assert same.status_code == 200


def test_logout_revokes_the_session(server):
    client = login(server.base_url)
    token = client.cookies["omlx_session"]
    assert client.post("/api/auth/logout").json() == {"authenticated": False}
    r = httpx.get(server.base_url + "/api/system", cookies={"omlx_session": token})
    assert r.status_code == 401


def test_a_session_also_opens_the_inference_routes(server, admin):
    assert admin.get("/v1/models").status_code == 200
    r = admin.post("/v1/chat/completions", json={"model": "tiny-llama", "max_tokens": 3,
                                                 "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    bare = httpx.Client(base_url=server.base_url, cookies=admin.cookies)
    r = bare.post("/v1/models/tiny-llama/load")
    assert r.status_code == 403  # state change by cookie without the dashboard header


# ----- sub-keys ------------------------------------------------------------------------
def test_subkeys_are_inference_only_hashed_and_revocable(server, admin):
    r = admin.post("/api/keys", json={"name": "laptop"})
    assert r.status_code == 200
    created = r.json()
    key = created["key"]
    assert key.startswith("omlx-sk-") and created["name"] == "laptop"
    stored = (server.home / "api_keys.json").read_text()
    assert key not in stored and created["id"] in stored
    assert (server.home / "api_keys.json").stat().st_mode & 0o077 == 0
    listed = admin.get("/api/keys").json()["keys"]
    assert [k["name"] for k in listed] == ["laptop"] and "key" not in listed[0] and "hash" not in listed[0]

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=60)
    out = client.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert out.usage.completion_tokens >= 1
    denied = httpx.get(server.base_url + "/api/system", headers={"Authorization": f"Bearer {key}"})
    assert denied.status_code == 403 and error_of(denied)["code"] == "subkey_not_allowed"
    assert httpx.post(server.base_url + "/api/auth/login", json={"api_key": key}).status_code == 401
    assert admin.get("/api/keys").json()["keys"][0]["last_used"] is not None

    assert admin.delete(f"/api/keys/{created['id']}").json()["deleted"] is True
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    assert key not in server.log()


def test_subkey_validation(admin):
    assert admin.post("/api/keys", json={"name": ""}).status_code == 400
    assert admin.post("/api/keys", json={"name": "x" * 65}).status_code == 400
    assert admin.post("/api/keys", json={}).status_code == 400
    assert admin.post("/api/keys", json={"name": "dup"}).status_code == 200
    r = admin.post("/api/keys", json={"name": "dup"})
    assert r.status_code == 400 and "already exists" in error_of(r)["message"]
    assert admin.delete("/api/keys/doesnotexist").status_code == 404


# ----- global settings -----------------------------------------------------------------
def test_settings_lists_every_setting_with_its_source(admin):
    from omlx.settings import SETTINGS

    body = admin.get("/api/settings").json()
    items = {s["name"]: s for s in body["settings"]}
    assert set(items) == {s.name for s in SETTINGS}
    assert items["api_key"]["value"] == "***" and items["api_key"]["editable"] is False
    assert items["api_key"]["source"] == "cli"
    assert items["hf_endpoint"]["env"] == "OMLX_HF_ENDPOINT"
    assert items["compute_dtype"]["choices"][0] == "auto"
    assert items["default_max_tokens"]["live"] is True and items["port"]["live"] is False


@pytest.mark.parametrize(
    "patch,param,fragment",
    [
        ({"compute_dtype": "fp8"}, "compute_dtype", "choose one of"),
        ({"port": 0}, "port", "below the minimum"),
        ({"port": "eighty"}, "port", "expected"),
        ({"max_concurrent_requests": 2.5}, "max_concurrent_requests", "integer"),
        ({"hot_cache_max_size": "lots"}, "hot_cache_max_size", "invalid size"),
        ({"hf_endpoint": "ftp://mirror"}, "hf_endpoint", "http(s) URL"),
        ({"no_cache": "maybe"}, "no_cache", "true or false"),
        ({"no_such_setting": 1}, "no_such_setting", "Unknown setting"),
        ({"api_key": "new"}, "api_key", "cannot be changed"),
        ({"port": [1]}, "port", "expected"),
    ],
)
def test_invalid_settings_are_refused_and_not_written(server, admin, patch, param, fragment):
    before = (server.home / "settings.json").read_text() if (server.home / "settings.json").exists() else None
    r = admin.put("/api/settings", json=patch)
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == param and fragment in error_of(r)["message"]
    after = (server.home / "settings.json").read_text() if (server.home / "settings.json").exists() else None
    assert before == after


def test_settings_body_must_be_a_non_empty_object(admin):
    assert admin.put("/api/settings", json=[1]).status_code == 400
    assert admin.put("/api/settings", json={}).status_code == 400
    assert admin.put("/api/settings", content=b"{oops").status_code == 400


def test_saved_settings_persist_and_say_what_needs_a_restart(server, admin):
    r = admin.put("/api/settings", json={"default_max_tokens": 5, "cache_block_size": 64, "log_level": "debug"})
    assert r.status_code == 200
    body = r.json()
    assert "cache_block_size" in body["restart_required"]
    assert "default_max_tokens" not in body["restart_required"]
    on_disk = json.loads((server.home / "settings.json").read_text())
    assert on_disk["default_max_tokens"] == 5 and on_disk["cache_block_size"] == 64
    items = {s["name"]: s for s in body["settings"]}
    assert items["default_max_tokens"]["value"] == 5 and items["default_max_tokens"]["source"] == "file"
    assert items["cache_block_size"]["value"] == 256  # still the running value
    # default_max_tokens applies at once: a request without max_tokens now stops after 5.
    out = httpx.post(server.base_url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"2": -100}})
    assert out.json()["usage"]["completion_tokens"] <= 5
    # null removes a value from the file: back to the default.
    body = admin.put("/api/settings", json={"cache_block_size": None, "default_max_tokens": None,
                                            "log_level": "info"}).json()
    on_disk = json.loads((server.home / "settings.json").read_text())
    assert "cache_block_size" not in on_disk and "default_max_tokens" not in on_disk
    assert body["restart_required"] == []
    assert {s["name"]: s for s in body["settings"]}["default_max_tokens"]["value"] == 4096


# ----- logs, system, status ------------------------------------------------------------
def test_logs_tail_returns_only_newer_lines(admin):
    first = admin.get("/api/logs", params={"after": 0}).json()
    assert first["capacity"] == 2000 and first["lines"]
    last = first["last"]
    admin.post("/api/keys", json={"name": f"log-probe-{time.time()}"})
    newer = admin.get("/api/logs", params={"after": last}).json()
    assert newer["lines"] and all(line["seq"] > last for line in newer["lines"])
    assert any("created sub-key" in line["message"] for line in newer["lines"])
    assert {"seq", "time", "level", "logger", "message"} <= set(newer["lines"][0])
    assert admin.get("/api/logs", params={"limit": 0}).status_code == 400
    assert admin.get("/api/logs", params={"after": "x"}).status_code == 400


def test_system_counts_requests_and_tokens(server, admin):
    before = admin.get("/api/system").json()["counters"]
    httpx.post(server.base_url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": "tiny-llama", "messages": [{"role": "user", "content": "count me"}], "max_tokens": 4})
    after = admin.get("/api/system").json()["counters"]
    assert after["requests"] == before["requests"] + 1
    assert after["completion_tokens"] >= before["completion_tokens"] + 1
    assert after["prompt_tokens"] > before["prompt_tokens"]
    assert after["models"]["tiny-llama"]["requests"] >= 1
    entry = admin.get("/api/status").json()["models"][0]
    assert entry["id"] == "tiny-llama"
    # only a CUDA engine warms attention graphs, up to its context window (the tiny model's 2,048)
    assert entry["graph_warmup"] is None or entry["graph_warmup"]["target"] == 2048


# ----- log files -----------------------------------------------------------------------
def test_log_file_has_one_json_object_per_line_with_request_id_and_model(server):
    r = httpx.post(server.base_url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": "tiny-llama", "messages": [{"role": "user", "content": "log me"}], "max_tokens": 2})
    request_id = r.json()["id"]
    deadline = time.time() + 10
    while time.time() < deadline:
        lines = [json.loads(line) for line in (server.log_dir / "omlx.log").read_text().splitlines()]
        mine = [line for line in lines if line["request_id"] == request_id]
        if mine:
            break
        time.sleep(0.1)
    assert all({"time", "level", "logger", "request_id", "model", "message"} <= set(line) for line in lines)
    assert any("Uvicorn running on" in line["message"] for line in lines)  # uvicorn's lines too
    assert mine and all(line["model"] == "tiny-llama" for line in mine)
    assert any("completion=" in line["message"] for line in mine)  # the engine thread's request line


# ----- /metrics -------------------------------------------------------------------------
def scrape(server, headers: dict[str, str] | None = None) -> dict[tuple[str, tuple], float]:
    """/metrics parsed: (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(server.base_url + "/metrics", headers=headers if headers is not None else AUTH)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def total(samples: dict, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))


def test_metrics_count_exactly_the_traffic_sent(server):
    assert httpx.get(server.base_url + "/metrics").status_code == 401  # protected like /v1
    before = scrape(server)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    prompt = [{"role": "user", "content": "metrics are counted here " * 40}]
    usages = [client.chat.completions.create(model="tiny-llama", messages=prompt, max_tokens=5).usage
              for _ in range(2)]  # the second restores the first's prompt
    stream = client.chat.completions.create(model="tiny-llama", messages=prompt, max_tokens=3, stream=True,
                                            stream_options={"include_usage": True})
    usages += [chunk.usage for chunk in stream if chunk.usage]
    r = httpx.post(server.base_url + "/v1/messages", headers=AUTH, timeout=60, json={
        "model": "tiny-llama", "max_tokens": 4, "messages": [{"role": "user", "content": "and this one"}]})
    anthropic_usage = r.json()["usage"]
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    m = {"model": "tiny-llama"}
    assert delta("omlx_request_success_total", endpoint="chat_completions", **m) == 3
    assert delta("omlx_request_success_total", endpoint="messages", **m) == 1
    prompt_tokens = sum(u.prompt_tokens for u in usages) + anthropic_usage["input_tokens"] + \
        anthropic_usage["cache_read_input_tokens"]
    completion = [u.completion_tokens for u in usages] + [anthropic_usage["output_tokens"]]
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages) + anthropic_usage["cache_read_input_tokens"]
    assert cached >= 2 * 200  # the second and third requests restored the prompt
    assert delta("omlx_prompt_tokens_total", **m) == delta("omlx_prefix_cache_queries_total", **m) == prompt_tokens
    assert delta("omlx_generation_tokens_total", **m) == sum(completion)
    assert delta("omlx_prefix_cache_hits_total", **m) == cached
    assert delta("omlx_time_to_first_token_seconds_count", **m) == sum(1 for c in completion if c)
    assert delta("omlx_inter_token_latency_seconds_count", **m) == sum(c - 1 for c in completion if c > 1)
    assert delta("omlx_e2e_request_latency_seconds_count", **m) == 4
    assert delta("omlx_e2e_request_latency_seconds_bucket", le="+Inf", **m) == 4
    assert delta("omlx_request_queue_time_seconds_count", **m) == 4
    assert total(after, "omlx_num_requests_running", **m) == 0
    assert total(after, "omlx_model_loaded", **m) == 1 and total(after, "omlx_model_loads_total", **m) >= 1
    assert delta("omlx_cache_tier_hits_total", tier="hot") >= 2  # the restores' blocks
    assert total(after, "omlx_cache_bytes", tier="hot") > 0
    assert total(after, "omlx_process_memory_bytes") > 0 and total(after, "omlx_device_memory_bytes", kind="active") > 0


# ----- model files ---------------------------------------------------------------------
def test_delete_model_files(server, admin, tiny_model_dir):
    models = Path(admin.get("/api/system").json()["model_dir"])
    shutil.copytree(tiny_model_dir / "tiny-llama", models / "org" / "doomed")
    hub = models / "models--org--cached" / "snapshots" / "abc"
    shutil.copytree(tiny_model_dir / "tiny-llama", hub)
    (models / "models--org--cached" / "refs").mkdir()
    (models / "models--org--cached" / "refs" / "main").write_text("abc")
    ids = [m["id"] for m in admin.get("/v1/models").json()["data"]]
    assert "org/doomed" in ids and "org/cached" in ids
    assert admin.post("/v1/models/org/doomed/load").status_code == 200

    r = admin.delete("/api/models/org/doomed/files")
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert not (models / "org").exists()  # the emptied org folder goes too
    r = admin.delete("/api/models/org/cached/files")
    assert r.status_code == 200 and not (models / "models--org--cached").exists()
    ids = [m["id"] for m in admin.get("/v1/models").json()["data"]]
    assert "org/doomed" not in ids and "org/cached" not in ids and "tiny-llama" in ids
    r = admin.delete("/api/models/org/doomed/files")
    assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"


# ----- benchmark -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "body,param",
    [
        ({}, "model"),
        ({"model": "tiny-llama", "prompt_tokens": 0}, "prompt_tokens"),
        ({"model": "tiny-llama", "max_tokens": 10**6}, "max_tokens"),
        ({"model": "tiny-llama", "concurrency": "2"}, "concurrency"),
        ({"model": "tiny-llama", "concurrency": True}, "concurrency"),
    ],
)
def test_bench_validation(admin, body, param):
    r = admin.post("/api/bench", json=body)
    assert r.status_code == 400 and error_of(r)["param"] == param


def test_bench_unknown_model_and_cancel_when_idle(admin):
    assert admin.post("/api/bench", json={"model": "nope"}).status_code == 404
    r = admin.post("/api/bench/cancel")
    assert r.status_code == 409


def wait_bench(admin, timeout=120) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = admin.get("/api/bench").json()
        if st["state"] != "running":
            return st
        time.sleep(0.3)
    raise AssertionError("benchmark did not finish")


def test_bench_runs_cold_then_warm_through_the_pool(admin):
    r = admin.post("/api/bench", json={"model": "tiny-llama", "prompt_tokens": 300, "max_tokens": 12, "concurrency": 2})
    assert r.status_code == 200 and r.json()["state"] == "running"
    assert admin.post("/api/bench", json={"model": "tiny-llama"}).status_code == 409
    st = wait_bench(admin)
    assert st["state"] == "completed", st
    cold, warm = st["phases"]["cold"], st["phases"]["warm"]
    assert cold["requests"] == warm["requests"] == 2
    assert cold["completion_tokens"] == warm["completion_tokens"] == 24  # EOS suppressed
    assert cold["prompt_tokens"] == 600 and cold["cached_tokens"] == 0
    assert warm["cached_tokens"] >= 2 * 256
    assert cold["ttft_avg_s"] > 0 and warm["throughput_tps"] > 0
    assert st["done"] == st["total"] == 4


def test_bench_too_long_for_the_window_fails_with_the_numbers(admin):
    admin.post("/api/bench", json={"model": "tiny-llama", "prompt_tokens": 2040, "max_tokens": 100})
    st = wait_bench(admin)
    assert st["state"] == "failed" and "2140" in st["error"] and "2048" in st["error"]


def test_bench_can_be_cancelled(admin):
    r = admin.post("/api/bench", json={"model": "tiny-llama", "prompt_tokens": 64, "max_tokens": 1900})
    assert r.status_code == 200
    deadline = time.time() + 60
    while admin.get("/api/bench").json()["tokens"] == 0 and time.time() < deadline:
        time.sleep(0.05)
    assert admin.post("/api/bench/cancel").status_code == 200
    st = wait_bench(admin)
    assert st["state"] == "cancelled" and st["tokens"] < 1900
