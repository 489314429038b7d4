"""The `--mcp-config` file (JSON or YAML), in either common form:

    {"servers": [{"name": "fs", "transport": "stdio", "command": "npx", "args": [...], "env": {...}},
                 {"name": "web", "transport": "streamable-http", "url": "http://127.0.0.1:9000/mcp"}]}
    {"mcpServers": {"fs": {"command": "npx", "args": [...], "env": {...}}, "web": {"url": "..."}}}

A URL without a transport is streamable HTTP, unless it ends in `/sse` (the older SSE transport).
A file that cannot be read or holds neither form stops the start with a message naming the problem.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omlx.errors import ConfigError

TRANSPORTS = ("stdio", "streamable-http", "sse")
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class ServerSpec:
    name: str
    transport: str  # one of TRANSPORTS
    command: str | None = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    url: str | None = None
    headers: dict[str, str] = field(default_factory=dict)


def _read(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"Cannot read the MCP config {path}: {exc}.") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{path} is YAML: install PyYAML (pip install 'omlx[mcp]'), or write it as JSON.") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"The MCP config {path} is not valid YAML: {exc}") from None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"The MCP config {path} is not valid JSON: {exc}") from None


def _strings(value: Any, where: str, kind: type) -> Any:
    if value is None:
        return kind()
    if kind is list and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    if kind is dict and isinstance(value, dict) and all(isinstance(v, str) for v in value.values()):
        return {str(k): v for k, v in value.items()}
    raise ConfigError(f"MCP config: {where} must be a {'list' if kind is list else 'map'} of strings.")


def _spec(name: Any, entry: Any, where: str) -> ServerSpec:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"MCP config: {where} needs a name of 1-64 letters, digits, '_' or '-' (got {name!r}).")
    if not isinstance(entry, dict):
        raise ConfigError(f"MCP config: {where} must be an object.")
    url, command = entry.get("url"), entry.get("command")
    transport = entry.get("transport") or entry.get("type")
    if transport in ("http", "streamable_http", "streamableHttp"):
        transport = "streamable-http"
    if transport is None:
        transport = "stdio" if command else ("sse" if str(url or "").rstrip("/").endswith("/sse") else "streamable-http")
    if transport not in TRANSPORTS:
        raise ConfigError(f"MCP config: {where}.transport must be one of {', '.join(TRANSPORTS)} (got {transport!r}).")
    if transport == "stdio" and not isinstance(command, str):
        raise ConfigError(f"MCP config: {where} (stdio) needs a 'command'.")
    if transport != "stdio" and not (isinstance(url, str) and url.startswith(("http://", "https://"))):
        raise ConfigError(f"MCP config: {where} ({transport}) needs an http(s) 'url'.")
    return ServerSpec(
        name, transport, command if transport == "stdio" else None, _strings(entry.get("args"), f"{where}.args", list),
        _strings(entry.get("env"), f"{where}.env", dict), url if transport != "stdio" else None,
        _strings(entry.get("headers"), f"{where}.headers", dict),
    )  # fmt: skip


def load_mcp_config(path: Path) -> list[ServerSpec]:
    """The servers the file declares, checked (see the module notes)."""
    data = _read(path)
    if isinstance(data, dict) and isinstance(data.get("mcpServers"), dict):
        specs = [_spec(name, entry, f"mcpServers.{name}") for name, entry in data["mcpServers"].items()]
    elif isinstance(data, dict) and isinstance(data.get("servers"), list):
        specs = [_spec((e or {}).get("name") if isinstance(e, dict) else None, e, f"servers.{i}")
                 for i, e in enumerate(data["servers"])]  # fmt: skip
    else:
        raise ConfigError(f"The MCP config {path} must hold {{\"servers\": [...]}} or {{\"mcpServers\": {{...}}}}.")
    names = [s.name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"MCP config {path}: server names must be unique; twice: {', '.join(twice)}.")
    return specs
