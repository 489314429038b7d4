"""`/v1/mcp/…`: the configured MCP servers, their tools, and one tool run on a caller's behalf.

`GET /v1/mcp/servers` lists each server with its state (connecting, ready, failed with the
error); `GET /v1/mcp/tools` the ready servers' tools; `POST /v1/mcp/execute` with
`{"name", "arguments"}` runs one tool within `--mcp-tool-timeout` and returns its result
(a tool's own error is a result with `is_error: true`). Errors are OpenAI-style bodies: 400 bad
body or arguments the server refused, 404 no such tool, 502 the server failed, 503 the server
is not ready, 504 timed out. Without `--mcp-config` both lists are empty.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from omlx.api.wire import Lenient
from omlx.mcp.manager import McpManager

router = APIRouter()


class ExecuteRequest(Lenient):
    name: str = Field(min_length=1, max_length=200)
    arguments: dict[str, Any] = Field(default_factory=dict)


def manager(request: Request) -> McpManager | None:
    return getattr(request.app.state, "mcp", None)


@router.get("/v1/mcp/servers")
async def mcp_servers(request: Request) -> dict[str, Any]:
    m = manager(request)
    return {"object": "list", "data": m.servers() if m else []}


@router.get("/v1/mcp/tools")
async def mcp_tools(request: Request) -> dict[str, Any]:
    m = manager(request)
    return {"object": "list", "data": [t.as_json() for t in m.tools()] if m else []}


@router.post("/v1/mcp/execute")
async def mcp_execute(body: ExecuteRequest, request: Request) -> dict[str, Any]:
    m = manager(request) or McpManager([])
    result = await m.call(body.name, body.arguments)
    return result.as_json()
