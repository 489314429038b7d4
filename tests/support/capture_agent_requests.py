"""Capture what the real agent CLIs send: a two-turn session of Claude Code, Codex and OpenCode
(installed by the test setup, tests/agents) against a scripted local server that asks each to
read a file on its first turn, so the requests carry tool calls and their results. The bodies
go to tests/integration/agent_requests/<agent>.json for the replay test.

Rerun when a CLI's pinned version changes (about a minute, no model):

    python -m tests.support.capture_agent_requests [claude codex opencode]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from omlx.api.responses_models import ResponsesRequest
from omlx.api.tool_calls import ReasoningDelta, TextDelta, ToolCall, new_call_id
from omlx.server.anthropic_events import MessageEvents
from omlx.server.chat_chunks import ChatChunks
from omlx.server.chat_pipeline import ChatFinal
from omlx.server.responses_events import ResponseEvents
from omlx.server.sse import sse_event
from tests.support.server import free_port

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "agents" / "node_modules" / ".bin"
OUT = ROOT / "integration" / "agent_requests"
MODEL = "pong"
FIRST = "Read the file hello.txt and tell me what it says."
SECOND = "Thanks. Now just say pong."
KEPT_HEADERS = ("anthropic-version", "anthropic-beta", "user-agent", "content-type", "openai-beta", "originator")
ARGS = {
    "claude": [["-p", FIRST], ["-p", "--continue", SECOND]],
    "codex": [["exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", FIRST],
              ["exec", "resume", "--last", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", SECOND]],
    "opencode": [["run", FIRST], ["run", "--continue", SECOND]],
}  # fmt: skip


def _read_call(tools: list[dict[str, Any]], path: str) -> ToolCall | None:
    """A call that reads `path` with the agent's own tool (file reader, else shell), or None."""
    by_name = {}
    for tool in tools:
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        if isinstance(fn.get("name"), str):
            by_name[fn["name"]] = fn.get("parameters") or fn.get("input_schema") or {}
    for name in ("Read", "read"):
        if name in by_name:
            key = next((k for k in by_name[name].get("properties", {}) if "path" in k.lower()), "file_path")
            return ToolCall(new_call_id(), name, json.dumps({key: path}))
    for name, schema in by_name.items():
        if "shell" in name or "exec" in name:
            props = schema.get("properties", {})
            key = next((k for k in ("cmd", "command") if k in props), "command")
            value: Any = ["cat", path] if props.get(key, {}).get("type") == "array" else f"cat {path}"
            return ToolCall(new_call_id(), name, json.dumps({key: value}))
    return None


def _answer(tools: list[dict[str, Any]], has_result: bool, path: str) -> list:
    """Reasoning then a call reading `path` before any tool result, then the answer: the
    requests that follow carry reasoning, a call and its result back."""
    call = None if has_result else _read_call(tools, path)
    return [ReasoningDelta("The user wants the file; I will read it."), call] if call else [TextDelta(MODEL)]


def _final(deltas: list) -> ChatFinal:
    reason = "tool_calls" if any(isinstance(d, ToolCall) for d in deltas) else "stop"
    return ChatFinal(reason, None, 100, 0, 2)


def capture_app(records: list[dict[str, Any]], path: str) -> FastAPI:
    """A server that records every request and answers as a model that reads `path` first."""
    app = FastAPI()

    async def record(request: Request) -> Any:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        headers = {k: v for k, v in request.headers.items() if k.lower() in KEPT_HEADERS}
        if headers.get("user-agent", "").startswith("python-httpx"):
            return body  # `omlx launch` itself, asking for the model
        records.append({"method": request.method, "path": request.url.path, "headers": headers, "body": body})
        return body

    @app.get("/")
    async def root(request: Request):
        return {"name": "oMLX", "version": "capture"}

    @app.get("/v1/models")
    async def models(request: Request):
        await record(request)
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "type": "llm", "context_length": 32768}]}

    @app.get("/api/system")
    async def system(request: Request):
        return {"device": {"type": "cpu"}}

    @app.post("/v1/messages")
    async def messages(request: Request):
        body = await record(request)
        has_result = any(isinstance(m.get("content"), list) and any(b.get("type") == "tool_result" for b in m["content"])
                         for m in body.get("messages", []))  # fmt: skip
        deltas = _answer(body.get("tools") or [], has_result, path)
        enc = MessageEvents("msg_capture", body.get("model", MODEL), 100)
        lines = enc.start() + enc.feed(deltas) + enc.finish(_final(deltas))
        if body.get("stream"):
            return StreamingResponse(iter(lines), media_type="text/event-stream")
        return JSONResponse(enc.message(_final(deltas)))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        await record(request)
        return {"input_tokens": 100}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await record(request)
        has_result = any(m.get("role") == "tool" for m in body.get("messages", []))
        deltas = _answer(body.get("tools") or [], has_result, path)
        enc = ChatChunks("chatcmpl-capture", body.get("model", MODEL), int(time.time()),
                         include_usage=bool((body.get("stream_options") or {}).get("include_usage")))  # fmt: skip
        lines = enc.start() + enc.feed(0, deltas) + enc.finish(0, _final(deltas)) + enc.end([_final(deltas)])
        if body.get("stream"):
            return StreamingResponse(iter(lines), media_type="text/event-stream")
        return JSONResponse({"id": "chatcmpl-capture", "object": "chat.completion", "created": 0, "model": MODEL,
                             "choices": [enc.choice_body(0, _final(deltas))],
                             "usage": {"prompt_tokens": 100, "completion_tokens": 2, "total_tokens": 102}})

    @app.post("/v1/responses")
    async def responses(request: Request):
        body = await record(request)
        items = body.get("input") if isinstance(body.get("input"), list) else []
        has_result = any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in items)
        deltas = _answer(body.get("tools") or [], has_result, path)
        enc = ResponseEvents(ResponsesRequest(model=body.get("model", MODEL), input="x"))
        events = enc.start() + enc.feed(deltas) + enc.finish(_final(deltas))
        if body.get("stream"):
            return StreamingResponse(iter([sse_event(n, p) for n, p in events]), media_type="text/event-stream")
        return JSONResponse(enc.final_response)

    @app.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "HEAD"])
    async def other(rest: str, request: Request):
        await record(request)
        return JSONResponse({"error": {"message": "not captured", "type": "not_found"}}, status_code=404)

    return app


def capture(agent: str, out: Path = OUT) -> Path:
    """Run the agent's two turns against the capture server; write and return its record file."""
    records: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix=f"omlx-capture-{agent}-"))
    scratch, home = work / "repo", work / "home"
    scratch.mkdir()
    home.mkdir()
    (scratch / "hello.txt").write_text("The secret word is pong.\n")
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(capture_app(records, str(scratch / "hello.txt")), port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    env = {**os.environ, "HOME": str(home), "OMLX_HOME": str(home / ".omlx"), "PATH": f"{BIN}:{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT.parent), "PWD": str(scratch)}  # fmt: skip
    try:
        for args in ARGS[agent]:
            cmd = [sys.executable, "-m", "omlx", "launch", agent, "--url", f"http://127.0.0.1:{port}", "--model", MODEL,
                   "--", *args]  # fmt: skip
            done = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=300)
            print(f"{agent} {args[:2]}: exit {done.returncode}; stdout {done.stdout.strip()[-200:]!r}", flush=True)
            if done.returncode:
                print(done.stderr[-3000:], file=sys.stderr)
    finally:
        server.should_exit = True
    version = subprocess.run([str(BIN / agent), "--version"], capture_output=True, text=True).stdout.strip()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{agent}.json"
    text = json.dumps({"agent": agent, "version": version, "requests": records}, indent=1, ensure_ascii=False)
    path.write_text(text.replace(str(work), "/tmp/agent-session") + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("agents", nargs="*", default=list(ARGS))
    for agent in ap.parse_args().agents:
        print("wrote", capture(agent))


if __name__ == "__main__":
    main()
