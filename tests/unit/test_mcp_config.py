"""`--mcp-config`: both common forms, JSON and YAML, and the messages a bad file gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omlx.errors import ConfigError
from omlx.mcp.config import ServerSpec, load_mcp_config


def _write(tmp_path: Path, name: str, data: object) -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_the_servers_list_form_in_yaml(tmp_path: Path) -> None:
    path = _write(tmp_path, "mcp.yaml", """
servers:
  - name: fs
    transport: stdio
    command: npx
    args: ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"]
    env: {DEBUG: "1"}
  - name: web
    transport: streamable-http
    url: http://127.0.0.1:9000/mcp
    headers: {Authorization: Bearer x}
  - name: old
    transport: sse
    url: http://127.0.0.1:9001/sse
""")
    assert load_mcp_config(path) == [
        ServerSpec("fs", "stdio", "npx", ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"], {"DEBUG": "1"}),
        ServerSpec("web", "streamable-http", url="http://127.0.0.1:9000/mcp", headers={"Authorization": "Bearer x"}),
        ServerSpec("old", "sse", url="http://127.0.0.1:9001/sse"),
    ]


def test_the_mcp_servers_map_form_in_json_infers_transports(tmp_path: Path) -> None:
    path = _write(tmp_path, "mcp.json", {"mcpServers": {
        "everything": {"command": "npx", "args": ["@modelcontextprotocol/server-everything"]},
        "remote": {"url": "https://example.com/mcp"},
        "legacy": {"url": "https://example.com/sse"},
        "typed": {"type": "http", "url": "https://example.com/x"},
    }})
    specs = {s.name: s for s in load_mcp_config(path)}
    assert specs["everything"] == ServerSpec("everything", "stdio", "npx", ["@modelcontextprotocol/server-everything"])
    assert [specs[n].transport for n in ("remote", "legacy", "typed")] == ["streamable-http", "sse", "streamable-http"]


@pytest.mark.parametrize(("data", "needle"), [
    ({"tools": []}, '"servers"'),
    ({"servers": [{"name": "a b", "command": "x"}]}, "servers.0 needs a name"),
    ({"servers": [{"name": "a", "transport": "ws", "url": "http://x"}]}, "servers.0.transport"),
    ({"mcpServers": {"a": {"args": ["x"]}}}, "needs an http(s) 'url'"),
    ({"mcpServers": {"a": {"transport": "stdio"}}}, "needs a 'command'"),
    ({"mcpServers": {"a": {"command": "x", "args": "y"}}}, "mcpServers.a.args must be a list"),
    ({"mcpServers": {"a": {"command": "x", "env": {"K": 1}}}}, "mcpServers.a.env must be a map"),
    ({"servers": [{"name": "a", "command": "x"}, {"name": "a", "command": "y"}]}, "twice: a"),
])
def test_a_bad_config_names_the_problem(tmp_path: Path, data: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_mcp_config(_write(tmp_path, "mcp.json", data))
    assert needle in str(exc.value)


def test_unreadable_or_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="Cannot read"):
        load_mcp_config(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_mcp_config(_write(tmp_path, "bad.json", "{"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_mcp_config(_write(tmp_path, "bad.yml", "servers: [unclosed"))


def test_the_tool_loop_hands_back_only_calls_of_the_requests_own_tools() -> None:
    from omlx.api.tool_calls import ToolCall
    from omlx.server.mcp_loop import for_the_client

    tools = [{"name": "mine", "parameters": {}}, {"name": "web", "parameters": {}}]
    def calls(*names: str) -> list[ToolCall]:
        return [ToolCall(f"call_{n}", n, "{}") for n in names]
    assert for_the_client(calls("web", "mine"), {"web"}, tools)
    assert not for_the_client(calls("web"), {"web"}, tools)
    assert not for_the_client(calls("web", "add"), {"web"}, tools)  # `add`: nobody's, fails in the loop
