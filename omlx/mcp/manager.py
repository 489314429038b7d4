"""The MCP servers of `--mcp-config`, connected in the background through the official `mcp` SDK.

Contract:
- `McpManager.start()` returns at once: each server is connected by its own asyncio task, so a
  slow, broken or missing server never holds up the start. A server's state is `connecting`,
  `ready` (its tools listed) or `failed` (with the error; retried after 1 s, doubling up to
  60 s, for as long as the server runs; a server that was up for a minute retries from 1 s).
- A ready server is pinged every `PING_INTERVAL_S`; a ping or call that finds the connection
  gone marks it failed and reconnects it (a stdio server is started again).
- `call()` runs one tool within its timeout: a tool's own error (`isError`) is a result; a
  timeout is `ToolTimeoutError` (504), a server not ready or gone is 503 / 502, an unknown tool
  404, arguments the server refuses 400. Nothing a server does raises anything else.
- The connections live on a thread of their own with a plain asyncio loop (`call` and `close`
  hand over to it): uvloop, the server's loop, starts a process with fork(), which runs
  OpenBLAS's fork handler; that stops OpenBLAS's worker threads, and a matrix product in flight
  on an engine thread then waits for them forever. Plain asyncio starts processes with vfork().
- Tool names are the servers' own; where two ready servers offer the same name, each becomes
  `<server>__<tool>`. Characters other than letters, digits, `_` and `-` become `_`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import threading
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from omlx.errors import (
    InvalidRequestError,
    NotFoundError,
    OMLXError,
    ServiceUnavailableError,
    UpstreamError,
)
from omlx.mcp.config import ServerSpec

log = logging.getLogger("omlx.mcp")

CONNECT_TIMEOUT_S = 30.0  # start (stdio), initialize and list tools
PING_INTERVAL_S = 15.0
PING_TIMEOUT_S = 15.0
RETRY_FIRST_S, RETRY_MAX_S, STABLE_S = 1.0, 60.0, 60.0
STOP_WAIT_S = 5.0
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


class ToolTimeoutError(OMLXError):
    """The MCP tool did not answer within its timeout (504)."""

    status = 504
    error_type = "timeout_error"


@dataclass
class McpTool:
    name: str  # as offered to models and clients
    server: str
    remote: str  # the server's own name for it
    description: str
    input_schema: dict[str, Any]

    def spec(self) -> dict[str, Any]:
        """The tool as the chat pipeline's `{"name", "description", "parameters"}`."""
        return {"name": self.name, "description": self.description, "parameters": self.input_schema}

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "server": self.server, "tool": self.remote, "description": self.description,
                "input_schema": self.input_schema}  # fmt: skip


@dataclass
class ToolResult:
    tool: McpTool
    is_error: bool
    content: list[dict[str, Any]]
    structured: Any = None

    def text(self) -> str:
        """The result as the model reads it: text parts joined, other parts named."""
        parts = []
        for c in self.content:
            kind = c.get("type")
            if kind == "text":
                parts.append(str(c.get("text", "")))
            elif kind in ("image", "audio"):
                parts.append(f"[{kind}: {c.get('mimeType', 'unknown type')}]")
            elif kind == "resource":
                res = c.get("resource") or {}
                parts.append(str(res.get("text") if res.get("text") is not None else f"[resource {res.get('uri')}]"))
            elif kind == "resource_link":
                parts.append(f"[resource {c.get('uri')}]")
        if not parts and self.structured is not None:
            import json

            parts.append(json.dumps(self.structured))
        return "\n".join(parts)

    def as_json(self) -> dict[str, Any]:
        return {"name": self.tool.name, "server": self.tool.server, "tool": self.tool.remote,
                "is_error": self.is_error, "content": self.content, "structured_content": self.structured,
                "text": self.text()}  # fmt: skip


@dataclass
class Connection:
    """One configured server and what is known of it."""

    spec: ServerSpec
    state: str = "connecting"
    error: str | None = None
    tools: list[Any] = field(default_factory=list)  # mcp.types.Tool, as listed
    session: Any = None
    attempts: int = 0
    ready_since: float | None = None
    next_retry_at: float | None = None
    server_info: dict[str, Any] | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    dead: str | None = None  # why the connection is gone, once a call found out

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.spec.name, "transport": self.spec.transport,
            "target": self.spec.url or " ".join([self.spec.command or "", *self.spec.args]).strip(),
            "state": self.state, "error": self.error, "tools": len(self.tools) if self.state == "ready" else 0,
            "attempts": self.attempts, "server_info": self.server_info,
            "next_retry_in_s": round(max(0.0, self.next_retry_at - time.monotonic()), 1)
            if self.state == "failed" and self.next_retry_at else None,
        }  # fmt: skip

    def lost(self, why: str) -> None:
        """A call found the connection gone: no call goes to it until it is connected again."""
        if self.dead is None:
            self.dead = why
            self.state, self.error = "failed", why
            self.wake.set()


def _describe(exc: BaseException) -> str:
    """One line naming what went wrong (the first leaf of an exception group)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class McpManager:
    """Every configured server's connection and tools (see the module notes)."""

    def __init__(self, specs: list[ServerSpec], *, tool_timeout: float = 30.0, log_dir: Path | None = None,
                 connect_timeout: float = CONNECT_TIMEOUT_S):  # fmt: skip
        self.connections = {s.name: Connection(s) for s in specs}
        self.tool_timeout = tool_timeout
        self.connect_timeout = connect_timeout
        self.log_dir = log_dir
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the MCP thread and each server's connection task on it; returns at once."""
        if not self.connections:
            return
        self._loop = asyncio.SelectorEventLoop()  # not the policy's: never uvloop (see the notes)
        self._thread = threading.Thread(target=self._loop.run_forever, name="omlx-mcp", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start_tasks(), self._loop)

    async def _start_tasks(self) -> None:
        for conn in self.connections.values():
            self._tasks.append(asyncio.create_task(self._keep(conn), name=f"mcp-{conn.spec.name}"))

    async def close(self) -> None:
        """Disconnect every server (stdio servers are stopped) and end the MCP thread, waiting
        at most about 2 × `STOP_WAIT_S`."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            await asyncio.wait_for(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._close(), loop)),
                                   2 * STOP_WAIT_S + 1)  # fmt: skip
        except (TimeoutError, RuntimeError):
            log.warning("MCP servers did not all stop in time")
        loop.call_soon_threadsafe(loop.stop)
        await asyncio.to_thread(thread.join, STOP_WAIT_S)

    async def _close(self) -> None:
        self._stopping = True
        for conn, task in zip(self.connections.values(), self._tasks, strict=False):
            conn.wake.set()  # a ready one leaves its session
            if conn.state != "ready":
                task.cancel()  # one still connecting, or waiting to retry
        if not self._tasks:
            return
        _, pending = await asyncio.wait(self._tasks, timeout=STOP_WAIT_S)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=STOP_WAIT_S)

    async def _keep(self, conn: Connection) -> None:
        delay = RETRY_FIRST_S
        while not self._stopping:
            conn.state, conn.dead, conn.attempts = "connecting", None, conn.attempts + 1
            conn.wake.clear()
            try:
                await self._session(conn)
                why = conn.dead
            except asyncio.CancelledError:
                if self._stopping:
                    break
                why = "cancelled"
            except BaseException as exc:  # noqa: BLE001 — whatever a server does, it stays here
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                why = _describe(exc)
            if self._stopping:
                break
            if conn.ready_since is not None and time.monotonic() - conn.ready_since > STABLE_S:
                delay = RETRY_FIRST_S
            conn.state, conn.error, conn.session, conn.ready_since = "failed", why or "disconnected", None, None
            conn.next_retry_at = time.monotonic() + delay
            log.warning("MCP server %s: %s; retrying in %.0f s", conn.spec.name, conn.error, delay)
            conn.wake.clear()
            try:
                await asyncio.wait_for(conn.wake.wait(), delay)
            except TimeoutError:
                pass
            delay = min(delay * 2, RETRY_MAX_S)
        conn.state, conn.session = "stopped", None

    async def _session(self, conn: Connection) -> None:
        """Connect, list tools, then serve calls until the connection is lost or we stop."""
        import anyio
        from mcp import ClientSession

        errlog = self._errlog(conn.spec.name)
        try:
            with anyio.CancelScope() as scope:
                scope.deadline = anyio.current_time() + self.connect_timeout
                async with AsyncExitStack() as stack:
                    streams = await self._transport(conn.spec, stack, errlog)
                    session = await stack.enter_async_context(
                        ClientSession(streams[0], streams[1], read_timeout_seconds=timedelta(seconds=self.connect_timeout))
                    )
                    init = await session.initialize()
                    tools = await _list_tools(session)
                    scope.deadline = math.inf
                    conn.tools, conn.session, conn.state, conn.error = tools, session, "ready", None
                    conn.server_info = init.serverInfo.model_dump(mode="json", exclude_none=True)
                    conn.ready_since, conn.next_retry_at = time.monotonic(), None
                    log.info("MCP server %s: ready, %d tools", conn.spec.name, len(tools))
                    await self._watch(conn, session)
            if scope.cancelled_caught:
                raise TimeoutError(f"no answer within {self.connect_timeout:g} s (start, initialize, list tools)")
        finally:
            if errlog is not None:
                errlog.close()

    async def _watch(self, conn: Connection, session: Any) -> None:
        import anyio

        while not self._stopping and conn.dead is None:
            with anyio.move_on_after(PING_INTERVAL_S):
                await conn.wake.wait()
            if self._stopping or conn.dead is not None:
                return
            try:
                with anyio.fail_after(PING_TIMEOUT_S):
                    await session.send_ping()
            except Exception as exc:  # noqa: BLE001
                conn.lost(f"ping failed: {_describe(exc)}")

    def _errlog(self, name: str) -> TextIO | None:
        """A stdio server's stderr goes to `<log dir>/mcp-<name>.log` (else to ours)."""
        if self.log_dir is None:
            return None
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            return open(self.log_dir / f"mcp-{name}.log", "a")  # noqa: SIM115 — closed by _session
        except OSError:
            return None

    async def _transport(self, spec: ServerSpec, stack: AsyncExitStack, errlog: TextIO | None) -> tuple[Any, Any]:
        if spec.transport == "stdio":
            import sys

            from mcp.client.stdio import StdioServerParameters, stdio_client

            params = StdioServerParameters(command=spec.command or "", args=spec.args, env=spec.env or None)
            try:
                streams = await stack.enter_async_context(stdio_client(params, errlog=errlog or sys.stderr))
            except OSError as exc:
                raise OSError(f"cannot start {spec.command}: {exc.strerror or exc}") from None
        elif spec.transport == "sse":
            from mcp.client.sse import sse_client

            streams = await stack.enter_async_context(
                sse_client(spec.url or "", headers=spec.headers or None, timeout=self.connect_timeout)
            )
        else:
            import httpx
            from mcp.client.streamable_http import streamable_http_client

            client = await stack.enter_async_context(
                httpx.AsyncClient(headers=spec.headers or None, timeout=httpx.Timeout(self.connect_timeout, read=300))
            )
            streams = await stack.enter_async_context(streamable_http_client(spec.url or "", http_client=client))
        return streams[0], streams[1]

    # -- what clients see ------------------------------------------------------------------
    def servers(self) -> list[dict[str, Any]]:
        return [c.as_json() for c in self.connections.values()]

    def tools(self) -> list[McpTool]:
        """The ready servers' tools under their offered names (see the module notes)."""
        listed = [(c, t) for c in self.connections.values() if c.state == "ready" for t in c.tools]
        counts: dict[str, int] = {}
        for _, t in listed:
            counts[_UNSAFE.sub("_", t.name)] = counts.get(_UNSAFE.sub("_", t.name), 0) + 1
        out = []
        for conn, t in listed:
            name = _UNSAFE.sub("_", t.name)
            if counts[name] > 1:
                name = f"{conn.spec.name}__{name}"
            out.append(McpTool(name[:128], conn.spec.name, t.name, t.description or "",
                               t.inputSchema or {"type": "object", "properties": {}}))  # fmt: skip
        return out

    def find(self, name: str) -> McpTool | None:
        return next((t for t in self.tools() if t.name == name), None)

    async def call(self, name: str, arguments: dict[str, Any] | None, timeout: float | None = None) -> ToolResult:
        """Run one tool (see the module notes for what it raises), from any event loop."""
        tool = self._callable(name)
        timeout = self.tool_timeout if timeout is None else timeout
        assert self._loop is not None
        done = asyncio.run_coroutine_threadsafe(self._call(tool, arguments, timeout), self._loop)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(done), timeout + 1)
        except TimeoutError:
            done.cancel()
            raise ToolTimeoutError(f"MCP tool '{name}' did not answer within {timeout:g} s.", code="tool_timeout") from None

    def _callable(self, name: str) -> McpTool:
        tool = self.find(name)
        if tool is None:
            known = [t.name for t in self.tools()]
            down = [c.spec.name for c in self.connections.values() if c.state != "ready"]
            hint = f" MCP tools: {', '.join(known[:50])}." if known else " No MCP tool is available."
            hint += f" Servers not ready: {', '.join(down)}." if down else ""
            raise NotFoundError(f"No MCP tool named '{name}'.{hint}", param="name", code="tool_not_found")
        conn = self.connections[tool.server]
        if conn.state != "ready" or conn.session is None or self._loop is None:
            raise ServiceUnavailableError(f"MCP server '{tool.server}' is {conn.state}.", retry_after=2)
        return tool

    async def _call(self, tool: McpTool, arguments: dict[str, Any] | None, timeout: float) -> ToolResult:
        """`call` on the MCP thread."""
        from mcp.shared.exceptions import McpError
        from mcp.types import CONNECTION_CLOSED, INVALID_PARAMS

        name, conn = tool.name, self.connections[tool.server]
        session = conn.session
        if conn.state != "ready" or session is None:
            raise ServiceUnavailableError(f"MCP server '{tool.server}' is {conn.state}.", retry_after=2)
        try:
            async with asyncio.timeout(timeout):
                result = await session.call_tool(tool.remote, arguments or {}, read_timeout_seconds=timedelta(seconds=timeout))
        except TimeoutError:
            raise ToolTimeoutError(f"MCP tool '{name}' did not answer within {timeout:g} s.", code="tool_timeout") from None
        except McpError as exc:
            if exc.error.code == INVALID_PARAMS:
                raise InvalidRequestError(f"MCP tool '{name}': {exc.error.message}", param="arguments") from None
            if exc.error.code == 408:  # the SDK's read timeout
                raise ToolTimeoutError(f"MCP tool '{name}' did not answer within {timeout:g} s.", code="tool_timeout") from None
            if exc.error.code == CONNECTION_CLOSED:
                conn.lost(f"connection closed during a call to {tool.remote}")
            raise UpstreamError(f"MCP server '{tool.server}' failed the call: {exc.error.message}") from None
        except Exception as exc:  # noqa: BLE001 — the transport broke
            conn.lost(_describe(exc))
            raise UpstreamError(f"MCP server '{tool.server}' failed the call: {_describe(exc)}") from None
        content = [c.model_dump(mode="json", exclude_none=True) for c in result.content]
        return ToolResult(tool, bool(result.isError), content, result.structuredContent)


async def _list_tools(session: Any) -> list[Any]:
    tools, cursor = [], None
    for _ in range(100):  # pages
        page = await session.list_tools(cursor=cursor) if cursor else await session.list_tools()
        tools += page.tools
        cursor = page.nextCursor
        if not cursor:
            break
    return tools
