"""The requests current Claude Code, Codex and OpenCode really send (captured from the pinned
CLIs by tests/support/capture_agent_requests.py: two turns with reasoning, a tool call and its
result), replayed against `omlx serve`: every one is answered (streamed, as sent) and the
second turn restores at least the first turn's prompt less one cache block."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.pong_model import ANSWER, build_pong_model
from tests.support.qwen_coder import qwen_coder_dir
from tests.support.server import ServerProcess

CAPTURED = Path(__file__).resolve().parent / "agent_requests"
MODEL = "pong"
BLOCK = 256


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay-models")
    build_pong_model(root / MODEL, qwen_coder_dir())
    home = tmp_path_factory.mktemp("replay-home")
    srv = ServerProcess(home, ["--model-dir", str(root), "--model", MODEL, "--hot-cache-only"])
    srv.start()
    yield srv
    srv.stop()
    shutil.rmtree(home, ignore_errors=True)


def captured(agent: str) -> list[dict[str, Any]]:
    return [r for r in json.loads((CAPTURED / f"{agent}.json").read_text())["requests"] if r["method"] == "POST"]


def sse(text: str) -> list[tuple[str | None, Any]]:
    """(event name, decoded data) of each event; comments and [DONE] left out."""
    out = []
    for block in text.split("\n\n"):
        name, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: ") and line != "data: [DONE]":
                data = json.loads(line[6:])
        if data is not None:
            out.append((name, data))
    return out


def replay(server, record: dict[str, Any]) -> tuple[str, int, int]:
    """Send one captured request as it was; (answer text, prompt tokens, restored tokens)."""
    body = {**record["body"], "model": MODEL}
    r = httpx.post(server.base_url + record["path"], json=body, headers=record["headers"], timeout=300)
    assert r.status_code == 200, r.text[:500]
    assert body.get("stream") and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    assert not [d for n, d in events if n == "error" or "error" in d], events[-3:]
    if record["path"] == "/v1/messages":
        text = "".join(d["delta"].get("text", "") for n, d in events if n == "content_block_delta")
        usage = next(d["usage"] for n, d in events if n == "message_delta")
        assert events[-1][0] == "message_stop"
        return text, usage["input_tokens"] + usage["cache_read_input_tokens"], usage["cache_read_input_tokens"]
    if record["path"] == "/v1/responses":
        done = events[-1][1]["response"]
        assert events[-1][0] == "response.completed", done
        text = "".join(d["delta"] for n, d in events if n == "response.output_text.delta")
        return text, done["usage"]["input_tokens"], done["usage"]["input_tokens_details"]["cached_tokens"]
    text = "".join(c["delta"].get("content") or "" for _, d in events for c in d["choices"])
    assert any(c.get("finish_reason") for _, d in events for c in d["choices"])
    usage = next(d["usage"] for _, d in events if d.get("usage"))  # OpenCode asks for it
    return text, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def test_the_captures_hold_what_the_clis_send_that_once_broke_servers():
    """A re-capture must keep these shapes, or this test stops guarding them."""
    claude = [r["body"] for r in captured("claude")]
    last = claude[-1]["messages"]
    assert any(m["role"] == "system" for m in last)  # a system message mid-conversation
    assert "cache_control" in json.dumps(claude) and claude[0]["max_tokens"] == 32000
    assert {b["type"] for m in last if isinstance(m["content"], list) for b in m["content"]} >= {
        "thinking", "tool_use", "tool_result", "text"}
    codex = captured("codex")[-1]["body"]["input"]
    assert {i.get("type") for i in codex} >= {"reasoning", "function_call", "function_call_output", "message"}
    assert any(i.get("role") == "developer" for i in codex)
    opencode = captured("opencode")[-1]["body"]["messages"]
    assert any(m.get("reasoning_content") for m in opencode) and any(m["role"] == "tool" for m in opencode)


@pytest.mark.parametrize("agent", ["claude", "codex", "opencode"])
def test_every_captured_request_is_answered_and_the_second_turn_restores_the_first(server, agent):
    results = [(record, replay(server, record)) for record in captured(agent)]
    assert all(answer == ANSWER for _, (answer, _, _) in results), [a for _, (a, _, _) in results]
    turns = [(prompt, restored) for record, (_, prompt, restored) in results if record["body"].get("tools")]
    first, second = turns[0], turns[-1]
    assert second[1] >= first[0] - BLOCK, turns
