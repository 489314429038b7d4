"""Memory admission on a real GPU, without `--max-kv-memory`: the device's own memory is the
limit. A tiny model with a wide KV cache (128 KiB a token) and a window of 2**21 tokens holds
less in the GPU's memory than its window; a prompt longer than what the memory holds gets a
400 naming the limit (never an out-of-memory crash), and the server goes on serving.
Skipped unless MLX's CUDA backend sees a GPU.
"""

from __future__ import annotations

import re
import shutil

import httpx
import pytest

mx = pytest.importorskip("mlx.core")

pytestmark = pytest.mark.skipif(
    not (hasattr(mx, "cuda") and mx.cuda.is_available()), reason="needs MLX's CUDA backend and a GPU"
)

from omlx.pool.memory import memory_limit_total  # noqa: E402
from tests.support.server import ServerProcess  # noqa: E402
from tests.support.tiny_model import build_tiny_llama  # noqa: E402

MODEL = "tiny-wide-kv"
WINDOW = 1 << 21
# 8 layers x 16 KV heads x head_dim 128 x (keys + values) x 4 bytes (float32)
BYTES_PER_TOKEN = 8 * 16 * 128 * 2 * 4


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    models = tmp_path_factory.mktemp("models")
    build_tiny_llama(
        models / MODEL, hidden=256, layers=8, heads=16, kv_heads=16, context=WINDOW, extra_config={"head_dim": 128}
    )
    home = tmp_path_factory.mktemp("home")
    proc = ServerProcess(home, ["--model-dir", str(models), "--model", MODEL])
    proc.start()
    yield proc
    proc.stop()
    shutil.rmtree(home, ignore_errors=True)


def test_a_prompt_past_the_device_memory_gets_a_400_and_the_server_serves_on(server):
    device_bytes = memory_limit_total()  # the GPU's memory, as the engine reads it
    assert WINDOW * BYTES_PER_TOKEN > device_bytes, "the window must not fit this GPU for the test to mean anything"
    prompt = [3 + i % 400 for i in range(WINDOW - 16)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    answer = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
    assert answer.status_code == 400, answer.text[:500]
    message = answer.json()["error"]["message"]
    found = re.search(r"at most (\d+) tokens .*\((\d+) bytes per token", message)
    assert found, message
    held, per_token = int(found.group(1)), int(found.group(2))
    assert per_token == BYTES_PER_TOKEN, message
    assert 0 < held * per_token <= device_bytes and held < len(prompt), message

    ok = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt[:300], "max_tokens": 8, "temperature": 0},
        timeout=120,
    )
    assert ok.status_code == 200, ok.text[:500]
    assert ok.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
