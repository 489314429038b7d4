"""An MCP server written for the tests, on the official SDK's FastMCP: run it as
`python tests/support/mcp_servers.py stdio` or `... http PORT` (streamable HTTP on loopback,
path /mcp). Its tools: echo, pick (an enum argument, so a forced call's arguments are bounded),
slow (sleeps), fail (the tool's own error), crash (the process exits mid-call)."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Literal

from mcp.server.fastmcp import FastMCP


def build(port: int = 0) -> FastMCP:
    server = FastMCP("omlx-test", host="127.0.0.1", port=port, log_level="WARNING")

    @server.tool()
    def echo(text: str) -> str:
        """Say the text back."""
        return f"echo: {text}"

    @server.tool()
    def pick(color: Literal["red", "green"]) -> str:
        """Pick a color."""
        return f"picked {color} at {os.getpid()}"

    @server.tool()
    async def slow(seconds: float) -> str:
        """Sleep, then answer."""
        await asyncio.sleep(seconds)
        return "slept"

    @server.tool()
    def fail(message: str) -> str:
        """Fail with the message."""
        raise ValueError(message)

    @server.tool()
    def crash() -> str:
        """End the server's process."""
        os._exit(3)

    return server


if __name__ == "__main__":
    if sys.argv[1] == "stdio":
        build().run()
    else:
        build(int(sys.argv[2])).run(transport="streamable-http")
