"""Memory admission through a real `omlx serve` with a small KV limit (`--max-kv-memory`):
a prompt that can never fit gets a 400 naming the limit, `max_tokens` is clamped to what
memory holds, a request reserves its prompt plus a margin (not all of `max_tokens`) and
waits while it does not fit, and decoding sequences that outgrow memory pause the newest,
which later goes on to the output it would have had alone.
"""

from __future__ import annotations

import concurrent.futures as cf
import shutil
import time

import httpx
import pytest

from tests.support.server import ServerProcess
from tests.support.tiny_model import build_tiny_llama

MODEL = "tiny-mem"
# hidden 256, 4 layers, 2 KV heads of 64, float32: 4 x 2 x 2 x 64 x 4 = 4,096 bytes a token
BYTES_PER_TOKEN = 4096
HOLDS = 2048  # tokens that --max-kv-memory 8MiB holds
NO_EOS = {"2": -100}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    models = tmp_path_factory.mktemp("models")
    build_tiny_llama(models / MODEL, context=32768)
    home = tmp_path_factory.mktemp("home")
    proc = ServerProcess(home, ["--model-dir", str(models), "--model", MODEL, "--max-kv-memory", "8MiB"])
    proc.start()
    yield proc
    proc.stop()
    shutil.rmtree(home, ignore_errors=True)


def complete(server: ServerProcess, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logit_bias": NO_EOS}
    answer = httpx.post(server.base_url + "/v1/completions", json=body, timeout=600)
    assert answer.status_code == 200, answer.text
    return answer.json()


def prompt_of(n: int, seed: int) -> list[int]:
    return [3 + (i * 31 + seed * 977) % 400 for i in range(n)]


def status(server: ServerProcess) -> dict:
    return httpx.get(server.base_url + "/api/status", timeout=10).json()


def test_a_prompt_that_can_never_fit_gets_a_400_naming_the_limit(server):
    body = {"model": MODEL, "prompt": prompt_of(HOLDS + 10, 1), "max_tokens": 4}
    answer = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    message = answer.json()["error"]["message"]
    assert f"at most {HOLDS} tokens" in message and "--max-kv-memory" in message, message


def test_max_tokens_32000_is_admitted_at_once_and_clamped_to_memory(server):
    tic = time.monotonic()
    result = complete(server, prompt_of(1000, 2), 32000)
    assert result["choices"][0]["finish_reason"] == "length"
    assert result["usage"]["completion_tokens"] == HOLDS - 1000
    assert time.monotonic() - tic < 120


def test_a_request_that_does_not_fit_now_waits_for_room(server):
    a, b = prompt_of(1200, 3), prompt_of(1200, 4)  # each reserves 1,200 + 512: not both at once
    with cf.ThreadPoolExecutor(2) as pool:
        first = pool.submit(complete, server, a, 200)
        time.sleep(0.5)
        second = pool.submit(complete, server, b, 200)
        seen_waiting = False
        while not second.done():
            seen_waiting |= status(server)["waiting_requests"] == 1
            time.sleep(0.05)
        together = [first.result(), second.result()]
    assert seen_waiting
    assert [r["choices"][0]["text"] for r in together] == [complete(server, p, 200)["choices"][0]["text"] for p in (a, b)]


def test_sequences_that_outgrow_memory_pause_the_newest_which_then_goes_on(server):
    a, b = prompt_of(400, 5), prompt_of(400, 6)  # reserve 912 each, together 1,824: both admitted
    alone = [complete(server, p, 1000)["choices"][0]["text"] for p in (a, b)]  # 1,400 each at the end
    before = next(m for m in status(server)["models"] if m["id"] == MODEL).get("paused_for_memory", 0)
    with cf.ThreadPoolExecutor(2) as pool:
        first = pool.submit(complete, server, a, 1000)
        time.sleep(0.3)
        second = pool.submit(complete, server, b, 1000)
        together = [first.result()["choices"][0]["text"], second.result()["choices"][0]["text"]]
    after = next(m for m in status(server)["models"] if m["id"] == MODEL)["paused_for_memory"]
    assert after > before, "nothing was paused: the test did not outgrow memory"
    assert together == alone
