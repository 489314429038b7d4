"""A long-running server meets a new prompt length with almost every request. On MLX's CUDA
backend each new (chunk, context) shape builds a cuDNN attention graph kept in an LRU, and
MLX 0.32 raises an error for every new shape once a process has missed twice that LRU's
capacity (its "cache thrashing" check). `omlx serve` turns the check off; this test shrinks
the LRU so that a few dozen distinct prompt lengths cross the line, and checks that every
request is still answered — and, as the control, that with MLX's check on they are not.

Skipped unless MLX's CUDA backend is installed and sees a GPU. On an H200 with MLX 0.32.4
(2026-11-30, seventh session) both failed: past the LRU a process lost its CUDA context
("illegal memory access"), check on or off; with CUDA graphs off, or an LRU that never
evicts, all 40 were answered (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import httpx
import pytest

from tests.support.server import ServerProcess
from tests.support.tiny_model import build_tiny_llama

mx = pytest.importorskip("mlx.core")

pytestmark = pytest.mark.skipif(
    not (hasattr(mx, "cuda") and mx.cuda.is_available()), reason="needs MLX's CUDA backend and a GPU"
)

LRU = 8
# prefill chunks lie on a 256-token grid (omlx/engine/solo.py): prompts 256 apart end in
# chunks of new (query, key) shapes, 40 of them: five times the LRU
LENGTHS = [100 + 256 * i for i in range(5 * LRU)]


@pytest.fixture(scope="module")
def bf16_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    # half precision and as many key/value heads as query heads: MLX's cuDNN attention path
    build_tiny_llama(root / "tiny-bf16", dtype="bfloat16", kv_heads=4, context=16384)
    return root


def answered(models: Path, home: Path, check: str) -> tuple[list[int], str]:
    """HTTP status of one completion per prompt length, with MLX's check set to `check`, and
    what went wrong (each failed request's answer, then the end of the server's log)."""
    env = {"MLX_CUDA_SDPA_CACHE_SIZE": str(LRU), "MLX_ENABLE_CACHE_THRASHING_CHECK": check}
    server = ServerProcess(home, ["--model-dir", str(models), "--model", "tiny-bf16", "--no-cache"], env=env)
    server.start()
    rng = random.Random(7)
    statuses, failures = [], []
    try:
        for n in LENGTHS:
            body = {"model": "tiny-bf16", "prompt": [rng.randrange(3, 400) for _ in range(n)], "max_tokens": 2}
            r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
            statuses.append(r.status_code)
            if r.status_code != 200:
                failures.append(f"{n} tokens: {r.status_code} {r.text[:300]}")
        assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
    finally:
        server.stop()
        log = server.log()[-4000:]
        shutil.rmtree(home, ignore_errors=True)
    return statuses, "\n".join(failures) + "\n--- server log ---\n" + log


def test_every_new_prompt_length_is_answered_past_the_shape_cache(bf16_model_dir, tmp_path):
    statuses, why = answered(bf16_model_dir, tmp_path / "off", "0")
    assert statuses == [200] * len(LENGTHS), why


def test_control_mlx_check_on_fails_prefills_past_the_shape_cache(bf16_model_dir, tmp_path):
    """Without this failing, the test above would not exercise what it claims to."""
    statuses, why = answered(bf16_model_dir, tmp_path / "on", "1")
    assert statuses[:LRU] == [200] * LRU, why
    assert any(s >= 500 for s in statuses), f"MLX's thrashing check no longer trips: revisit runner.py's override\n{why}"
    assert "Cache thrashing" in why, why
