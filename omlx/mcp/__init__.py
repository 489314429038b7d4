"""MCP servers' tools for oMLX (`--mcp-config`): the config file's two common forms, a manager
that connects to each server in the background through the official `mcp` SDK (the `omlx[mcp]`
extra), and the server-side tool loop a request can opt in to (docs/agents.md)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omlx.errors import ConfigError

if TYPE_CHECKING:
    from omlx.mcp.manager import McpManager
    from omlx.settings import Settings


def mcp_manager(settings: Settings) -> McpManager | None:
    """The manager of `--mcp-config`'s servers (not started), or None without one. A file that
    is unreadable or malformed, or a missing `mcp` package, is a `ConfigError`."""
    if settings.mcp_config is None:
        return None
    from omlx.mcp.config import load_mcp_config

    specs = load_mcp_config(settings.mcp_config)
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise ConfigError("--mcp-config needs the MCP SDK: pip install 'omlx[mcp]'.") from None
    from omlx.mcp.manager import McpManager

    return McpManager(specs, tool_timeout=settings.mcp_tool_timeout, log_dir=settings.home / "logs")
