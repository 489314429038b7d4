"""On a CUDA GPU an idle server feeds each loaded model a dummy prompt once, in the 2,048-token
chunks of a lone prompt, so that MLX builds their attention graphs before a user's long
prompt needs them (omlx/engine/graph_warmup.py). What it saves is measured by
`benchmarks/gpu/bench_gpu.py` (part g), not here: this checks that it runs to its depth,
reports itself, and leaves the server answering long prompts.

Skipped unless MLX's CUDA backend is installed and sees a GPU.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx
import pytest

from tests.support.server import ServerProcess
from tests.support.tiny_model import build_tiny_llama

mx = pytest.importorskip("mlx.core")

pytestmark = pytest.mark.skipif(
    not (hasattr(mx, "cuda") and mx.cuda.is_available()), reason="needs MLX's CUDA backend and a GPU"
)


def warmup_of(server: ServerProcess) -> dict | None:
    return httpx.get(server.base_url + "/api/status", timeout=5).json()["models"][0]["graph_warmup"]


def test_an_idle_server_warms_the_graphs_of_long_prompts_up_to_the_context(tmp_path: Path) -> None:
    models = tmp_path / "models"
    build_tiny_llama(models / "tiny-bf16", dtype="bfloat16", kv_heads=4, context=16384)
    server = ServerProcess(tmp_path / "home", ["--model-dir", str(models), "--model", "tiny-bf16", "--no-cache"])
    server.start()
    try:
        deadline = time.monotonic() + 120
        while not (warmup_of(server) or {}).get("done"):
            assert time.monotonic() < deadline, warmup_of(server)
            time.sleep(0.2)
        assert warmup_of(server) == {"tokens": 16384, "target": 16384, "done": True}  # the context, not 32,768
        assert "built the attention graphs of tiny-bf16 for prompts up to 16384 tokens" in server.log()
        rng = random.Random(5)
        body = {"model": "tiny-bf16", "prompt": [rng.randrange(3, 400) for _ in range(16000)], "max_tokens": 4}
        r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens"] == 16000 and 1 <= usage["completion_tokens"] <= 4
    finally:
        server.stop()
