"""Long contexts on the CPU through a real `omlx serve`: a tiny model at 32k tokens cold,
hit, hit + tail and restart + hit, each equal (greedy) to the prompt computed without the
cache; a prefill cut short by its client keeps what it computed for the retry; and requests
whose prompts share a prefill compute it once.
"""

from __future__ import annotations

import shutil
import time

import httpx
import pytest

from tests.integration.test_disconnects import read_until, send_raw, status, wait_for
from tests.support.server import ServerProcess
from tests.support.tiny_model import build_tiny_llama

MODEL = "tiny-32k"
NO_EOS = {"2": -100}  # random weights: EOS would end some outputs after a token or two


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("models")
    # small enough that 32k tokens of attention prefill in well under a minute on 2 cores
    build_tiny_llama(root / MODEL, hidden=128, layers=2, heads=2, kv_heads=1, context=40000)
    return root


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("home")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def serve(models, home, *extra: str) -> ServerProcess:
    server = ServerProcess(home, ["--model-dir", str(models), "--model", MODEL, *extra])
    server.start()
    return server


def complete(server: ServerProcess, prompt: list[int], max_tokens: int = 8) -> tuple[list[str], int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "logit_bias": NO_EOS, "logprobs": 0}
    answer = httpx.post(server.base_url + "/v1/completions", json=body, timeout=600)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    return data["choices"][0]["logprobs"]["tokens"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def prompt_of(n: int, seed: int) -> list[int]:
    return [3 + (i * 7919 + seed * 104729) % 400 for i in range(n)]


def test_32k_tokens_cold_hit_tail_and_restart_equal_no_cache(models, home, tmp_path):
    prompt, tail = prompt_of(32_000, 1), prompt_of(100, 2)
    server = serve(models, home)
    try:
        cold, cached = complete(server, prompt)
        assert cached == 0
        hit, cached = complete(server, prompt)
        assert cached >= 32_000 - 256 and hit == cold
        with_tail, cached = complete(server, prompt + tail)
        assert cached >= 32_000 - 256
    finally:
        server.stop()
    reference = serve(models, tmp_path / "nocache", "--no-cache")
    try:
        assert complete(reference, prompt + tail)[0] == with_tail
    finally:
        reference.stop()
    again = serve(models, home)  # restarted: the blocks come back from the SSD
    try:
        after_restart, cached = complete(again, prompt + tail)
        assert cached >= 32_000 - 256 and after_restart == with_tail
    finally:
        again.stop()


def test_a_prefill_its_client_abandons_is_kept_for_the_retry(models, tmp_path):
    prompt = prompt_of(16_000, 3)
    server = serve(models, tmp_path / "home")
    try:
        sock = send_raw(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                    "stream": True, "temperature": 0, "logit_bias": NO_EOS})
        wait_for(server, lambda s: s[0] == 1, timeout=30)
        time.sleep(2.0)  # part of the way into the prefill
        assert status(server)[0] == 1, "the prefill ended before the client left"
        sock.close()
        wait_for(server, lambda s: s == (0, 0), timeout=10)
        retried, cached = complete(server, prompt)
        assert 256 <= cached < 16_000 - 256  # it goes on from where the first attempt stopped
    finally:
        server.stop()
    reference = serve(models, tmp_path / "nocache", "--no-cache")
    try:
        assert complete(reference, prompt)[0] == retried
    finally:
        reference.stop()


def test_requests_sharing_a_prompt_compute_its_prefill_once(models, tmp_path):
    prompt = prompt_of(8_000, 4)
    server = serve(models, tmp_path / "home")
    try:
        socks = [send_raw(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 4,
                                                      "temperature": 0, "logit_bias": NO_EOS})
                 for _ in range(3)]
        answers = [read_until(sock, b'"usage"', timeout=300).decode() for sock in socks]
        for sock in socks:
            sock.close()
    finally:
        server.stop()
    cached = sorted(int(a.split('"cached_tokens":')[1].split("}")[0]) for a in answers)
    assert cached[0] == 0 and all(c >= 8_000 - 256 for c in cached[1:]), cached
    prefills = [line for line in server.log().splitlines() if "request=cmpl" in line and "prompt=8000" in line]
    assert sum("cached=0 " in line for line in prefills) == 1, prefills
