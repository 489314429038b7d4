"""Server-wide options through a real subprocess: API key, backpressure."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.server import ServerProcess


def test_api_key_is_enforced_on_v1_but_not_health(tiny_model_dir, tmp_path):
    server = ServerProcess(tmp_path / "home", ["--model-dir", str(tiny_model_dir), "--api-key", "s3cret"])
    server.start()
    try:
        assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
        r = httpx.get(server.base_url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.get(server.base_url + "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        good = openai.OpenAI(base_url=server.base_url + "/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in good.models.list().data] == ["tiny-llama"]
        bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "x"}])
        assert "s3cret" not in server.log()
    finally:
        server.stop()


def test_full_queue_answers_429_with_retry_after(tiny_model_dir, tmp_path):
    server = ServerProcess(
        tmp_path / "home",
        ["--model-dir", str(tiny_model_dir), "--model", "tiny-llama",
         "--max-concurrent-requests", "1", "--max-waiting-requests", "0"],
    )
    server.start()
    try:
        body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "go"}],
                "max_tokens": 1500, "temperature": 0, "stream": True, "logit_bias": {"2": -100}}
        started = threading.Event()

        def long_stream():
            with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    started.set()

        t = threading.Thread(target=long_stream, daemon=True)
        t.start()
        assert started.wait(30)
        r = httpx.post(server.base_url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2})
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 1
        assert "busy" in r.json()["error"]["message"]
        t.join(60)
        # once the slot is free again, requests succeed
        deadline = time.time() + 10
        while time.time() < deadline:
            r = httpx.post(server.base_url + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2})
            if r.status_code == 200:
                break
            time.sleep(0.1)
        assert r.status_code == 200
    finally:
        server.stop()


@contextlib.contextmanager
def decoding_alongside(base_url: str, model: str) -> Iterator[None]:
    """A stream decoding in the background: its engine is never alone, so a new prompt goes
    in `--prefill-step-size` chunks between its decode steps, on every device (a request
    alone in its engine is prefilled in large chunks on a CUDA GPU, too fast to wait on)."""
    started, stop = threading.Event(), threading.Event()

    def run() -> None:
        body = {"model": model, "prompt": "a b", "max_tokens": 12000, "stream": True, "logit_bias": {"2": -100}}
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                if stop.is_set():
                    return  # closing the stream cancels it

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(60), "the background stream never started"
    try:
        yield
    finally:
        stop.set()
        thread.join(60)


def test_keepalives_flow_while_a_long_prefill_runs(tmp_path):
    from tests.support.tiny_model import build_tiny_llama

    models = tmp_path / "models"
    build_tiny_llama(models / "slow", context=16384, hidden=512, layers=8)
    server = ServerProcess(
        tmp_path / "home",
        ["--model-dir", str(models), "--model", "slow", "--keepalive-interval", "0.05",
         "--prefill-step-size", "64", "--no-cache"],
    )
    server.start()
    try:
        prompt = "fox jumps " * 1500
        body = {"model": "slow", "max_tokens": 2, "stream": True, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}]}  # fmt: skip
        with decoding_alongside(server.base_url, "slow"):
            with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=120) as r:
                lines = [line for line in r.iter_lines() if line]
            with httpx.stream("POST", server.base_url + "/v1/messages", json=body, timeout=120) as r:
                events = [line for line in r.iter_lines() if line.startswith("event: ")]
        # the end of the prefill: the first chunk with generated output (text, or only the finish
        # when this random model's two tokens decode to no text, e.g. a partial character)
        first_output = next(
            i for i, line in enumerate(lines)
            if ('"content":"' in line and '"role"' not in line) or '"finish_reason":"' in line
        )  # fmt: skip
        assert any(line == ": keep-alive" for line in lines[:first_output])
        start = next(i for i, e in enumerate(events) if e in ("event: content_block_start", "event: message_delta"))
        assert events[1] == "event: ping" and events[:start].count("event: ping") >= 3
    finally:
        server.stop()
