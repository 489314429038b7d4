"""A long-running server meets a new prompt length with almost every request. On MLX's CUDA
backend prefill attention builds a cuDNN graph per (chunk, context) shape, kept in an LRU
(`MLX_CUDA_SDPA_CACHE_SIZE`); these tests shrink it to 8 and send 40 prompt lengths.

What the H200 showed (MLX 0.32.4, docs/design/gpu-findings.md#attention-graph-cache-entries):
- prompts in 512-token chunks: the 29th length lost the process's CUDA context ("illegal
  memory access"), and every later request failed;
- lone prompts (2,048-token chunks) were all answered, and with MLX's "cache thrashing" check
  on it never tripped, so these prefills built fewer than 16 graphs that the LRU had to make
  again; attention alone (40 shapes through an LRU of 8) trips the check at the 17th miss, and
  with the check off evicts without harm, CUDA graphs on or off.
So what loses the context is not plain eviction. The tests hold oMLX to what it controls:
lone prompts of new lengths are answered, and prompts two at a time (512-token chunks, the
case that lost the context) are answered, or, should the context be lost, the server says so on
`/health` and exits with code 75 for its supervisor to restart it, rather than answering
500 to everything from then on.

Skipped unless MLX's CUDA backend is installed and sees a GPU.
"""

from __future__ import annotations

import random
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from omlx.engine.device_fault import EXIT_DEVICE_LOST
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


def small_lru_server(models: Path, home: Path) -> ServerProcess:
    server = ServerProcess(
        home, ["--model-dir", str(models), "--model", "tiny-bf16", "--no-cache"],
        env={"MLX_CUDA_SDPA_CACHE_SIZE": str(LRU)},
    )  # fmt: skip
    server.start()
    return server


def complete(server: ServerProcess, n: int, seed: int) -> httpx.Response:
    rng = random.Random(seed)
    body = {"model": "tiny-bf16", "prompt": [rng.randrange(3, 400) for _ in range(n)], "max_tokens": 2}
    return httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)


def test_every_new_prompt_length_is_answered_past_the_shape_cache(bf16_model_dir, tmp_path):
    server = small_lru_server(bf16_model_dir, tmp_path / "home")
    failures = []
    try:
        for n in LENGTHS:
            r = complete(server, n, n)
            if r.status_code != 200:
                failures.append(f"{n} tokens: {r.status_code} {r.text[:300]}")
        assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
    finally:
        server.stop()
        log = server.log()[-4000:]
        shutil.rmtree(tmp_path / "home", ignore_errors=True)
    assert not failures, "\n".join(failures) + "\n--- server log ---\n" + log


def test_prompts_two_at_a_time_are_answered_or_a_lost_gpu_ends_the_process(bf16_model_dir, tmp_path):
    server = small_lru_server(bf16_model_dir, tmp_path / "home")
    answers: list[httpx.Response] = []
    try:
        with ThreadPoolExecutor(2) as pool:
            for pair in zip(LENGTHS[::2], LENGTHS[1::2], strict=True):
                answers += pool.map(lambda n: complete(server, n, n), pair)
                if any(r.status_code != 200 for r in answers):
                    break
        failed = [r for r in answers if r.status_code != 200]
        if not failed:
            assert len(answers) == len(LENGTHS)
            assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
            return
        # the CUDA context is gone: the server must say so and leave, not limp on
        assert all("illegal memory access" in r.text or "device_lost" in r.text for r in failed), failed[0].text
        try:
            health = httpx.get(server.base_url + "/health", timeout=5)
            assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        except httpx.ConnectError:
            pass  # it already left
        assert server.proc is not None and server.proc.wait(timeout=45) == EXIT_DEVICE_LOST
        warnings.warn(f"the CUDA context was lost after {len(answers)} requests; the server left with 75", stacklevel=1)
    finally:
        server.stop()
        shutil.rmtree(tmp_path / "home", ignore_errors=True)
