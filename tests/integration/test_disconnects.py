"""Clients that leave and clients that cannot be admitted, against a real `omlx serve`.

A request whose client is gone is cancelled within about a second in every phase (waiting,
a long prefill, decoding; streaming or not), and `/api/status` returns to 0 active and 0
waiting; a stream that cannot be admitted gets 429 + Retry-After before it starts, in the
caller's dialect, like a non-streaming request.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.support.server import ServerProcess
from tests.support.tiny_model import build_tiny_llama

MODEL = "tiny-long"
LONG = 6000  # prompt tokens: several seconds of prefill for this model on a 2-core CPU
CANCEL_S = 1.5  # a cancel waits for the chunk in flight (~0.4 s, prefill_pacing.py) and the status poll


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    models = tmp_path_factory.mktemp("models")
    build_tiny_llama(models / MODEL, context=32768)
    home = tmp_path_factory.mktemp("home")
    proc = ServerProcess(home, ["--model-dir", str(models), "--model", MODEL, "--no-cache",
                                "--max-concurrent-requests", "2", "--max-waiting-requests", "1"])
    proc.start()
    yield proc
    proc.stop()
    shutil.rmtree(home, ignore_errors=True)


def send_raw(server: ServerProcess, path: str, body: dict) -> socket.socket:
    """A request written to a socket of its own, so that the test can drop it at any moment."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n".encode() + data
    )
    return sock


def read_until(sock: socket.socket, marker: bytes, timeout: float = 60.0) -> bytes:
    sock.settimeout(timeout)
    seen = b""
    while marker not in seen:
        chunk = sock.recv(65536)
        if not chunk:
            break
        seen += chunk
    return seen


def status(server: ServerProcess) -> tuple[int, int]:
    body = httpx.get(server.base_url + "/api/status", timeout=10).json()
    return body["active_requests"], body["waiting_requests"]


def wait_for(server: ServerProcess, check: Callable[[tuple[int, int]], bool], timeout: float) -> float:
    """Seconds until `check(status)` holds; fails after `timeout`."""
    tic = time.monotonic()
    while time.monotonic() - tic < timeout:
        if check(status(server)):
            return time.monotonic() - tic
        time.sleep(0.05)
    pytest.fail(f"status {status(server)} did not reach the expected state within {timeout}s")


def long_completion(stream: bool, max_tokens: int = 8) -> dict:
    return {"model": MODEL, "prompt": [7 + i % 300 for i in range(LONG)], "max_tokens": max_tokens, "stream": stream}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_dropped_during_a_long_prefill_is_cancelled_within_a_second(server, stream: bool):
    sock = send_raw(server, "/v1/completions", long_completion(stream))
    wait_for(server, lambda s: s[0] == 1, timeout=30)
    time.sleep(1.0)  # well into the prefill
    assert status(server)[0] == 1, "the prefill ended before the client left: make LONG longer"
    sock.close()
    took = wait_for(server, lambda s: s == (0, 0), timeout=10)
    print(f"cancelled in {took:.2f}s")
    assert took < CANCEL_S


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
def test_dropped_while_decoding_is_cancelled(server, stream: bool):
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 20000, "stream": stream,
            "logit_bias": {"2": -100}}  # EOS unreachable: it would decode for a long time
    sock = send_raw(server, "/v1/completions", body)
    if stream:
        read_until(sock, b'"text"')  # a token has arrived: decoding
    else:
        wait_for(server, lambda s: s[0] == 1, timeout=30)
        time.sleep(1.0)
    sock.close()
    took = wait_for(server, lambda s: s == (0, 0), timeout=10)
    print(f"cancelled in {took:.2f}s")
    assert took < CANCEL_S


def test_dropped_while_waiting_leaves_the_queue_and_running_ones_are_cancelled_too(server):
    running = [send_raw(server, "/v1/completions", long_completion(True)) for _ in range(2)]
    wait_for(server, lambda s: s[0] == 2, timeout=30)
    waiting = send_raw(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "wait for me"}], "max_tokens": 4, "stream": True})
    wait_for(server, lambda s: s == (2, 1), timeout=10)
    waiting.close()
    assert wait_for(server, lambda s: s == (2, 0), timeout=10) < CANCEL_S
    for sock in running:
        sock.close()
    took = wait_for(server, lambda s: s == (0, 0), timeout=10)
    print(f"cancelled in {took:.2f}s")
    assert took < CANCEL_S


STREAMS = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}, "openai"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stream": True}, "openai"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}, "anthropic"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 4, "stream": True}, "openai"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2}, "openai"),
]


def test_streams_that_cannot_be_admitted_get_429_before_they_start(server):
    busy = [send_raw(server, "/v1/completions", long_completion(True)) for _ in range(3)]  # 2 running + 1 waiting
    try:
        wait_for(server, lambda s: s == (2, 1), timeout=30)
        for path, body, dialect in STREAMS:
            response = httpx.post(server.base_url + path, json={"model": MODEL, **body}, timeout=30)
            assert response.status_code == 429, (path, response.text)
            assert int(response.headers["retry-after"]) >= 1
            assert response.headers["content-type"].startswith("application/json")
            error = response.json()
            if dialect == "anthropic":
                assert error["type"] == "error" and error["error"]["type"] == "rate_limit_error"
            else:
                assert error["error"]["code"] == "server_overloaded"
    finally:
        for sock in busy:
            sock.close()
    wait_for(server, lambda s: s == (0, 0), timeout=10)
    ok = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200, ok.text


def test_a_storm_of_streams_beyond_the_queue_gets_429_not_in_band_errors(server):
    """100 streams at once against 2 slots and 1 place in the queue: every one either runs or
    gets a 429 before its stream starts; none gets a 200 carrying an error."""
    import concurrent.futures as cf

    def one(i: int) -> tuple[int, str]:
        body = {"model": MODEL, "prompt": f"storm {i}", "max_tokens": 16, "stream": True}
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120) as r:
            return r.status_code, r.read().decode()

    with cf.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(100)))
    codes = [code for code, _ in results]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) > 0 and codes.count(200) >= 3
    for code, text in results:
        if code == 200:
            assert '"error"' not in text and text.rstrip().endswith("data: [DONE]"), text[-300:]
    wait_for(server, lambda s: s == (0, 0), timeout=10)



def test_sigterm_during_a_long_prefill_stops_the_server_within_15_s(tmp_path: Path):
    """The stream in flight is answered (an error event, not a cut connection), the SSD
    writer's queue is flushed or dropped whole, and the next start loads the cache cleanly."""
    models = tmp_path / "models"
    build_tiny_llama(models / MODEL, context=32768)
    server = ServerProcess(tmp_path / "home", ["--model-dir", str(models), "--model", MODEL])
    server.start()
    try:
        finished = httpx.post(server.base_url + "/v1/completions", json=long_completion(False, 2), timeout=120)
        assert finished.status_code == 200  # its blocks go to the SSD while the next one runs
        sock = send_raw(server, "/v1/completions", {**long_completion(True), "prompt": [9] * 2 * LONG})
        wait_for(server, lambda s: s[0] == 1, timeout=30)
        time.sleep(1.0)
        tic = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(30)
        took = time.monotonic() - tic
        answer = read_until(sock, b"data: [DONE]", timeout=5).decode(errors="replace")
        sock.close()
    finally:
        server.stop()
    print(f"stopped in {took:.2f}s")
    assert took < 15, server.log()[-3000:]
    assert "shutting down" in answer, answer[-1000:]
    assert "Traceback" not in server.log()
    again = ServerProcess(tmp_path / "home", ["--model-dir", str(models), "--model", MODEL])
    again.start()
    try:
        hit = httpx.post(again.base_url + "/v1/completions", json=long_completion(False, 2), timeout=120).json()
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the first prompt's blocks survived
    finally:
        again.stop()
    loaded = re.findall(r"loaded: (\d+) blocks .*; (\d+) unreadable files discarded", again.log())
    assert loaded and int(loaded[-1][0]) > 0 and loaded[-1][1] == "0", again.log()[-3000:]
