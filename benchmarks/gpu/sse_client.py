"""Streaming client for the GPU benchmark: no MLX import, so it can run in worker processes.

One request = one streamed `/v1/chat/completions` call (a body with `messages`) or
`/v1/completions` call (a body with `prompt`: text or token ids). A record holds the send time,
the arrival time of every chunk that carried text, and the final usage, all on
`time.perf_counter()` (CLOCK_MONOTONIC on Linux, so times from several processes compare).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx


class _Unanswered(Exception):
    """The connection failed before any response arrived."""


def stream_completion(
    client: httpx.Client, base_url: str, body: dict[str, Any], timeout: float = 180.0
) -> dict[str, Any]:
    """One streamed request. A connection the server dropped before answering (a listen
    backlog overflowing under a burst: `mlx_lm.server`'s is socketserver's 5) is retried up
    to twice; the time lost counts (`sent` stays the first attempt's), `retries` says so."""
    sent = time.perf_counter()
    for attempt in range(3):
        try:
            return {**_stream_once(client, base_url, body, timeout, sent), "retries": attempt}
        except _Unanswered as exc:
            if attempt == 2:
                raise exc.__cause__ from None
    raise AssertionError("unreachable")


def _stream_once(
    client: httpx.Client, base_url: str, body: dict[str, Any], timeout: float, sent: float
) -> dict[str, Any]:
    times: list[float] = []
    lp_tokens: list[str] = []  # with `logprobs` in the body: each token's text and top logprobs
    lp_tops: list[Any] = []
    head = ""  # the answer's first characters (a structured answer's opening, say)
    usage: dict[str, Any] | None = None
    finish = None
    end = None  # arrival of the chunk with the finish reason: the last token's
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    request = client.build_request("POST", f"{base_url}{path}", json=body, timeout=timeout)
    try:
        r = client.send(request, stream=True)
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError) as exc:
        raise _Unanswered() from exc
    try:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:500]}")
        deadline = sent + timeout
        for line in r.iter_lines():
            # keep-alive comments keep httpx's read timeout from ever firing on a stuck
            # request, so the whole request gets a wall-clock limit too
            if time.perf_counter() > deadline:
                raise TimeoutError(f"no complete answer within {timeout:.0f} s")
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices", ()):
                text = ch.get("text") or (ch.get("delta") or {}).get("content")
                if text:
                    times.append(time.perf_counter())
                    if len(head) < 64:
                        head += text
                if ch.get("logprobs"):
                    lp_tokens += ch["logprobs"].get("tokens") or []
                    lp_tops += ch["logprobs"].get("top_logprobs") or []
                if ch.get("finish_reason"):
                    finish = ch["finish_reason"]
                    end = time.perf_counter()
    finally:
        r.close()
    done = time.perf_counter()
    usage = usage or {}
    return {
        "sent": sent,
        "done": done,
        "end": end or done,
        "times": times,
        "completion_tokens": usage.get("completion_tokens", len(times)),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "finish_reason": finish,
        "head": head[:64],
        "logprob_tokens": lp_tokens,
        "top_logprobs": lp_tops,
    }


def stream_group(
    base_url: str, bodies: list[dict[str, Any]], start_at: float, timeout: float = 180.0
) -> list[dict[str, Any]]:
    """Run `bodies` concurrently (one thread each), all sent at `start_at` (perf_counter)."""
    results: list[Any] = [None] * len(bodies)

    def one(i: int) -> None:
        with httpx.Client(timeout=timeout) as client:
            delay = start_at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            try:
                results[i] = stream_completion(client, base_url, bodies[i], timeout)
            except Exception as exc:  # reported to the driver, which fails the measurement
                results[i] = {"error": repr(exc)}

    cpu = time.process_time()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu = time.process_time() - cpu  # this client process's CPU time for the group
    for r in results:
        r["group_cpu_s"] = cpu
    return results


def ping(_: int = 0) -> float:
    return time.perf_counter()
