"""A model folder the server cannot load is not a server fault: a request for it gets a 503 in
the caller's dialect that names the model and the reason, and the other models keep serving."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tests.support.server import ServerProcess
from tests.support.tiny_model import build_tiny_llama


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    models = tmp_path_factory.mktemp("models")
    build_tiny_llama(models / "good")
    bad_config = build_tiny_llama(models / "bad-config")
    config = json.loads((bad_config / "config.json").read_text())
    config["num_hidden_layers"] = "four"
    (bad_config / "config.json").write_text(json.dumps(config))
    bad_type = build_tiny_llama(models / "bad-type")
    config = json.loads((bad_type / "config.json").read_text())
    config["model_type"] = "banana"
    (bad_type / "config.json").write_text(json.dumps(config))
    no_weights = build_tiny_llama(models / "no-weights")
    for f in no_weights.glob("*.safetensors*"):
        f.unlink()
    (no_weights / "model.safetensors").write_bytes(b"not a safetensors file")
    home = tmp_path_factory.mktemp("home")
    proc = ServerProcess(home, ["--model-dir", str(models)])
    proc.start()
    yield proc
    proc.stop()
    shutil.rmtree(home, ignore_errors=True)


def chat(server: ServerProcess, model: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=120)


def messages(server: ServerProcess, model: str, stream: bool = False) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": stream}
    return httpx.post(server.base_url + "/v1/messages", json=body, timeout=120)


@pytest.mark.parametrize(
    ("model", "reason"), [("bad-config", "TypeError"), ("bad-type", "banana"), ("no-weights", "Error")]
)
def test_a_model_that_fails_to_load_gets_a_503_naming_it_and_why(server, model: str, reason: str):
    for _ in range(2):  # a second request tries again and fails the same way
        answer = chat(server, model)
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert f"'{model}'" in error["message"] and reason in error["message"], error
        assert error["code"] == "model_load_failed" and error["param"] == "model", error
        assert "Traceback" not in answer.text
    answer = messages(server, model)
    assert answer.status_code == 503, answer.text
    body = answer.json()
    assert body["type"] == "error" and f"'{model}'" in body["error"]["message"], body
    streamed = messages(server, model, stream=True)
    assert streamed.status_code == 503, streamed.text  # refused before the stream starts
    assert good_model_serves(server)


def good_model_serves(server: ServerProcess) -> bool:
    answer = chat(server, "good")
    return answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1


def test_the_failed_models_show_their_state_and_others_keep_serving(server):
    chat(server, "bad-config")
    assert good_model_serves(server)
    status = httpx.get(server.base_url + "/v1/models/status", timeout=10).json()["data"]
    states = {m["id"]: m["state"] for m in status}
    assert states["good"] in ("loaded", "serving") and states["bad-config"] == "unloaded", states
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
