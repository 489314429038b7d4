"""Downloads from a Hugging Face hub on loopback, through the real huggingface_hub client."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from omlx.admin.downloads import hub_endpoint
from tests.admin.conftest import (
    API_KEY,
    BIG_REPO,
    HUB_REPO,
    login,
    start_server,
    writable_model_dir,
)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, fake_hub, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("admin-dl")
    models = writable_model_dir(tiny_model_dir, root)
    # HF_ENDPOINT (huggingface_hub's own variable) points at the fake hub; the hf_endpoint
    # setting stays unset so a test can change it live.
    srv = start_server(root / "home", models, "--api-key", API_KEY, env={"HF_ENDPOINT": fake_hub.url})
    srv.models = models
    yield srv
    srv.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture()
def admin(server):
    client = login(server.base_url)
    yield client
    client.close()


def wait_job(admin, job_id: str, states=("completed", "failed", "cancelled"), timeout=120) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        jobs = {j["id"]: j for j in admin.get("/api/downloads").json()["downloads"]}
        if jobs[job_id]["state"] in states:
            return jobs[job_id]
        time.sleep(0.2)
    raise AssertionError(f"download {job_id} did not reach {states}")


def test_hub_endpoint_prefers_the_setting_then_hf_endpoint(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://mirror.local/")
    assert hub_endpoint(SimpleNamespace(hf_endpoint=None)) == "http://mirror.local"
    assert hub_endpoint(SimpleNamespace(hf_endpoint="http://other:8080")) == "http://other:8080"
    monkeypatch.delenv("HF_ENDPOINT")
    assert hub_endpoint(SimpleNamespace(hf_endpoint=None)) == "https://huggingface.co"


def test_search_and_info_come_from_the_configured_hub(admin, fake_hub):
    r = admin.get("/api/hub/search", params={"q": "tiny"})
    assert r.status_code == 200
    body = r.json()
    assert body["endpoint"] == fake_hub.url
    assert [m["id"] for m in body["results"]] == [HUB_REPO]
    assert body["results"][0]["local"] is False
    assert [m["id"] for m in admin.get("/api/hub/search", params={"q": "torch"}).json()["results"]] == []
    assert [m["id"] for m in admin.get("/api/hub/search", params={"q": "torch", "mlx": "false"}).json()["results"]] == ["test-org/torch-only"]
    assert any(p.startswith("/api/models?") and "search=tiny" in p for _, p in fake_hub.requests)

    info = admin.get(f"/api/hub/models/{HUB_REPO}").json()
    names = {f["name"]: f for f in info["files"]}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(names)
    assert info["loadable"] is True and info["download_bytes"] == sum(f["size"] for f in info["files"])
    torch = admin.get("/api/hub/models/test-org/torch-only").json()
    assert torch["loadable"] is False and "safetensors" in torch["problem"]


def test_hub_errors_are_reported(admin):
    r = admin.get("/api/hub/models/test-org/missing")
    assert r.status_code == 404 and "not found" in r.json()["error"]["message"]
    assert admin.get("/api/hub/search", params={"limit": 0}).status_code == 400
    assert admin.get("/api/hub/models/bad..id/x").status_code == 400


@pytest.mark.parametrize("body", [{}, {"repo_id": "../etc"}, {"repo_id": "a/b/c"}, {"repo_id": 5},
                                  {"repo_id": "org/name", "revision": ""}])
def test_download_validation(admin, body):
    r = admin.post("/api/downloads", json=body)
    assert r.status_code == 400, r.text


def test_download_runs_the_real_client_and_the_model_serves(server, admin, fake_hub):
    fake_hub.requests.clear()
    r = admin.post("/api/downloads", json={"repo_id": HUB_REPO})
    assert r.status_code == 200
    job = r.json()
    again = admin.post("/api/downloads", json={"repo_id": HUB_REPO})
    assert again.status_code == 409
    done = wait_job(admin, job["id"])
    assert done["state"] == "completed", done
    assert done["downloaded_bytes"] == done["total_bytes"] > 9_000_000 and done["progress"] == 1.0
    target = server.models / "test-org" / "tiny-llama-mlx"
    assert done["target"] == str(target) and (target / "model.safetensors").exists()
    assert not (server.models / ".downloads").exists()
    paths = [p for _, p in fake_hub.requests]
    assert any("/resolve/" in p and p.endswith("/model.safetensors") for p in paths)
    assert any("/tree/" in p for p in paths)

    ids = [m["id"] for m in admin.get("/v1/models").json()["data"]]
    assert "test-org/tiny-llama-mlx" in ids
    out = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {API_KEY}"},
                     json={"model": "test-org/tiny-llama-mlx", "max_tokens": 3,
                           "messages": [{"role": "user", "content": "hi"}]})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] >= 1
    assert admin.get("/api/hub/search", params={"q": "tiny"}).json()["results"][0]["local"] is True

    exists = admin.post("/api/downloads", json={"repo_id": HUB_REPO})
    assert exists.status_code == 409 and exists.json()["error"]["code"] == "exists"
    assert admin.delete(f"/api/models/{HUB_REPO}/files").status_code == 200
    assert not target.exists()


def test_cancel_keeps_finished_files_and_retry_fetches_the_rest(server, admin, fake_hub):
    fake_hub.delay_per_chunk = 0.05  # 256 KiB per 50 ms
    try:
        job = admin.post("/api/downloads", json={"repo_id": BIG_REPO}).json()
        deadline = time.time() + 60
        while time.time() < deadline:
            j = {x["id"]: x for x in admin.get("/api/downloads").json()["downloads"]}[job["id"]]
            if j["state"] == "downloading" and j["downloaded_bytes"] > 10 << 20:
                break
            time.sleep(0.1)
        assert 0 < j["progress"] < 1 and j["total_bytes"] > 30 << 20
        assert admin.post(f"/api/downloads/{job['id']}/cancel").status_code == 200
        cancelled = wait_job(admin, job["id"])
        assert cancelled["state"] == "cancelled"
        assert 0 < cancelled["downloaded_bytes"] < cancelled["total_bytes"]
        assert (server.models / ".downloads" / "test-org--big-model").exists()
        assert BIG_REPO not in [m["id"] for m in admin.get("/v1/models").json()["data"]]
        assert admin.post(f"/api/downloads/{job['id']}/cancel").status_code == 409
    finally:
        fake_hub.delay_per_chunk = 0.0
    staging = server.models / ".downloads" / "test-org--big-model"
    assert not list(staging.rglob("*.incomplete"))  # a killed attempt's temp files are dropped
    fake_hub.requests.clear()
    assert admin.post(f"/api/downloads/{job['id']}/retry").status_code == 200
    done = wait_job(admin, job["id"])
    fetched = [p for m, p in fake_hub.requests if m == "GET" and "/resolve/" in p]
    assert fetched and not any(p.endswith("/config.json") for p in fetched)  # finished files are kept
    assert done["state"] == "completed", done
    target = server.models / "test-org" / "big-model"
    for name, src in fake_hub.repos[BIG_REPO].files.items():
        assert (target / name).read_bytes() == src.read_bytes(), name
    assert admin.post(f"/api/downloads/{job['id']}/retry").status_code == 409
    assert admin.delete(f"/api/downloads/{job['id']}").json()["removed"] is True
    assert job["id"] not in [j["id"] for j in admin.get("/api/downloads").json()["downloads"]]
    assert admin.delete(f"/api/models/{BIG_REPO}/files").status_code == 200


def test_failed_downloads_say_why(admin):
    job = admin.post("/api/downloads", json={"repo_id": "test-org/missing"}).json()
    failed = wait_job(admin, job["id"])
    assert failed["state"] == "failed" and "not found" in failed["error"]
    torch = admin.post("/api/downloads", json={"repo_id": "test-org/torch-only"}).json()
    failed = wait_job(admin, torch["id"])
    assert failed["state"] == "failed" and "safetensors" in failed["error"]
    for j in (job, torch):
        assert admin.delete(f"/api/downloads/{j['id']}").status_code == 200
    assert admin.delete("/api/downloads/nope").status_code == 404


def test_unreachable_hub_is_a_502_and_hf_endpoint_applies_live(admin, fake_hub):
    assert admin.put("/api/settings", json={"hf_endpoint": "http://127.0.0.1:9"}).status_code == 200
    try:
        r = admin.get("/api/hub/search", params={"q": "tiny"})
        assert r.status_code == 502 and "127.0.0.1:9" in r.json()["error"]["message"]
    finally:
        admin.put("/api/settings", json={"hf_endpoint": None})
    # Back to HF_ENDPOINT, the fake hub.
    assert admin.get("/api/downloads").json()["endpoint"] == fake_hub.url
