"""MCP through a real `omlx serve`: servers written here on the official SDK (stdio, and
streamable HTTP on loopback), `@modelcontextprotocol/server-everything` from npm (pinned in
tests/agents/package.json), a command that does not exist and one that never answers; the
tool routes, the API key, timeouts, a server that crashes mid-call, and the chat tool loop on
the tiny model."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.server import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
TEST_SERVER = ROOT / "tests" / "support" / "mcp_servers.py"
EVERYTHING = ROOT / "tests" / "agents" / "node_modules" / "@modelcontextprotocol" / "server-everything" / "dist" / "index.js"
KEY = "mcp-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TOOL_TIMEOUT_S = 2


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the MCP test server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("the MCP test server did not listen")


@pytest.fixture(scope="module")
def mcp_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("mcp", reason="the omlx[mcp] extra (the test extra installs it)")
    home = tmp_path_factory.mktemp("mcp-home")
    port = free_port()
    web = subprocess.Popen([sys.executable, str(TEST_SERVER), "http", str(port)], stdout=subprocess.DEVNULL,
                           stderr=open(home / "web.log", "wb"))  # noqa: SIM115
    servers = {
        "local": {"command": sys.executable, "args": [str(TEST_SERVER), "stdio"]},
        "web": {"url": f"http://127.0.0.1:{port}/mcp"},
        "broken": {"command": str(home / "no-such-mcp-server")},
        "hangs": {"command": sys.executable, "args": ["-c", "import time; time.sleep(600)"]},
    }
    node = shutil.which("node")
    if node and EVERYTHING.exists():
        servers["everything"] = {"command": node, "args": [str(EVERYTHING), "stdio"]}
    config = home / "mcp.json"
    config.write_text(json.dumps({"mcpServers": servers}))
    try:
        _wait_port(port, web)
        server = ServerProcess(home, ["--model-dir", str(tiny_model_dir), "--model", "tiny-llama", "--api-key", KEY,
                                      "--mcp-config", str(config), "--mcp-tool-timeout", str(TOOL_TIMEOUT_S)])
        server.start()
        yield server, web
        server.stop()
    finally:
        web.terminate()
        web.wait(10)
        shutil.rmtree(home, ignore_errors=True)


def _servers(base: str) -> dict[str, dict]:
    r = httpx.get(f"{base}/v1/mcp/servers", headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    return {s["name"]: s for s in r.json()["data"]}


def _wait_ready(base: str, names: list[str], timeout: float = 40) -> dict[str, dict]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        servers = _servers(base)
        if all(servers[n]["state"] == "ready" for n in names):
            return servers
        time.sleep(0.2)
    raise AssertionError(f"not ready in {timeout} s: {servers}")


def _execute(base: str, name: str, arguments: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{base}/v1/mcp/execute", json={"name": name, "arguments": arguments},
                      headers=AUTH if headers is None else headers, timeout=30)


def test_servers_connect_in_the_background_and_report_their_state(mcp_server) -> None:
    server, _ = mcp_server
    base = server.base_url
    # the start did not wait: a server that never answers is still connecting once /health is ok
    first = _servers(base)
    assert first["hangs"]["state"] == "connecting"
    servers = _wait_ready(base, ["local", "web"])
    assert servers["broken"]["state"] == "failed"
    assert "no-such-mcp-server" in servers["broken"]["error"]
    assert servers["local"]["tools"] == 5 and servers["local"]["server_info"]["name"] == "omlx-test"
    assert servers["web"]["transport"] == "streamable-http"
    # the model still answers while a server hangs
    r = httpx.post(f"{base}/v1/chat/completions", headers=AUTH, timeout=60,
                   json={"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert r.status_code == 200, r.text


def test_tools_are_listed_with_clashing_names_namespaced_by_server(mcp_server) -> None:
    base = mcp_server[0].base_url
    _wait_ready(base, ["local", "web"])
    tools = {t["name"]: t for t in httpx.get(f"{base}/v1/mcp/tools", headers=AUTH).json()["data"]}
    # the same five tools on two servers: each under <server>__<tool>
    for name in ("echo", "pick", "slow", "fail", "crash"):
        assert tools[f"local__{name}"]["server"] == "local" and tools[f"local__{name}"]["tool"] == name
        assert f"web__{name}" in tools and name not in tools
    assert tools["web__pick"]["input_schema"]["properties"]["color"]["enum"] == ["red", "green"]


def test_execute_runs_one_tool_behind_the_api_key(mcp_server) -> None:
    base = mcp_server[0].base_url
    _wait_ready(base, ["local", "web"])
    r = _execute(base, "local__echo", {"text": "hello"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"] == "echo: hello" and body["is_error"] is False and body["server"] == "local"
    assert body["content"] == [{"type": "text", "text": "echo: hello"}]
    assert _execute(base, "web__pick", {"color": "green"}).json()["text"].startswith("picked green")
    failed = _execute(base, "web__fail", {"message": "no disk"}).json()
    assert failed["is_error"] is True and "no disk" in failed["text"]
    assert _execute(base, "local__echo", {"text": "x"}, headers={}).status_code == 401
    missing = _execute(base, "nothing_here", {})
    assert missing.status_code == 404 and "nothing_here" in missing.json()["error"]["message"]
    bad = httpx.post(f"{base}/v1/mcp/execute", json={"name": "local__echo", "arguments": [1]}, headers=AUTH)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "arguments"


def test_a_slow_tool_times_out_and_a_crashing_server_comes_back(mcp_server) -> None:
    server, _ = mcp_server
    base = server.base_url
    _wait_ready(base, ["local", "web"])
    started = time.time()
    r = _execute(base, "web__slow", {"seconds": 20})
    assert r.status_code == 504 and r.json()["error"]["code"] == "tool_timeout"
    assert time.time() - started < TOOL_TIMEOUT_S + 3
    assert _execute(base, "web__echo", {"text": "still here"}).json()["text"] == "echo: still here"
    attempts = _servers(base)["local"]["attempts"]
    started = time.time()
    crashed = _execute(base, "local__crash", {})
    assert crashed.status_code == 502 and "local" in crashed.json()["error"]["message"]
    assert time.time() - started < TOOL_TIMEOUT_S + 3
    servers = _wait_ready(base, ["local"], timeout=20)  # started again
    assert servers["local"]["attempts"] == attempts + 1
    assert _execute(base, "local__echo", {"text": "again"}).json()["text"] == "echo: again"
    assert server.proc.poll() is None


def test_server_everything_from_npm(mcp_server) -> None:
    base = mcp_server[0].base_url
    if "everything" not in _servers(base):
        pytest.skip("node or tests/agents/node_modules missing: run `bash scripts/setup.sh test` (npm)")
    _wait_ready(base, ["everything"], timeout=60)
    tools = {t["tool"]: t["name"] for t in httpx.get(f"{base}/v1/mcp/tools", headers=AUTH).json()["data"]
             if t["server"] == "everything"}
    assert tools["echo"] == "everything__echo"  # three servers offer echo
    echoed = _execute(base, "everything__echo", {"message": "from oMLX"}).json()
    assert "from oMLX" in echoed["text"] and echoed["is_error"] is False
    total = _execute(base, tools["get-sum"], {"a": 2, "b": 3}).json()
    assert "5" in total["text"]
    image = _execute(base, tools["get-tiny-image"], {}).json()
    assert any(c["type"] == "image" for c in image["content"]) and "[image: image/png]" in image["text"]


def _loop(base: str, **body) -> httpx.Response:
    payload = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Pick a color."}], "max_tokens": 80,
               "temperature": 0, **body}
    return httpx.post(f"{base}/v1/chat/completions", json=payload, headers=AUTH, timeout=240)


def test_the_tool_loop_runs_the_models_calls_and_generates_again(mcp_server) -> None:
    base = mcp_server[0].base_url
    _wait_ready(base, ["local", "web"])
    r = _loop(base, mcp={"tools": ["web"], "max_rounds": 3},
              tool_choice={"type": "function", "function": {"name": "web__pick"}})
    assert r.status_code == 200, r.text
    body = r.json()
    added = body["mcp"]["messages"]
    call = added[0]["tool_calls"][0]
    assert added[0]["role"] == "assistant" and call["function"]["name"] == "web__pick"
    color = json.loads(call["function"]["arguments"])["color"]
    assert added[1] == {"role": "tool", "tool_call_id": call["id"], "name": "web__pick",
                        "content": added[1]["content"]}
    assert added[1]["content"].startswith(f"picked {color} at ")
    rounds = body["mcp"]["rounds"]
    assert len(rounds) >= 2
    # the second round's prompt is the first's, its answer and the result: the first restored
    assert rounds[1]["prompt_tokens"] > rounds[0]["prompt_tokens"] + rounds[0]["completion_tokens"]
    assert rounds[1]["cached_tokens"] >= rounds[0]["prompt_tokens"] - 16
    assert body["usage"]["completion_tokens"] == sum(x["completion_tokens"] for x in rounds)
    assert body["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")


def test_the_tool_loop_stops_at_its_round_limit_and_says_so(mcp_server) -> None:
    base = mcp_server[0].base_url
    _wait_ready(base, ["local", "web"])
    r = _loop(base, mcp={"tools": ["local__pick"], "max_rounds": 1},
              tool_choice={"type": "function", "function": {"name": "local__pick"}})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"][0]["function"]["name"] == "local__pick"
    assert body["mcp"] == {"rounds": body["mcp"]["rounds"], "messages": []} and len(body["mcp"]["rounds"]) == 1
    assert [w["code"] for w in choice["warnings"]] == ["mcp_max_rounds"]


def test_a_call_to_a_request_tool_ends_the_loop_and_goes_to_the_client(mcp_server) -> None:
    base = mcp_server[0].base_url
    _wait_ready(base, ["local", "web"])
    mine = {"type": "function", "function": {"name": "my_tool", "parameters": {
        "type": "object", "properties": {"flag": {"type": "boolean"}}, "required": ["flag"]}}}
    r = _loop(base, tools=[mine], mcp={"tools": ["web"]}, tool_choice={"type": "function", "function": {"name": "my_tool"}})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"][0]["function"]["name"] == "my_tool"
    assert body["mcp"]["messages"] == [] and len(body["mcp"]["rounds"]) == 1


def test_the_tool_loop_field_is_checked(mcp_server) -> None:
    base = mcp_server[0].base_url
    for mcp, param in (("yes", "mcp"), ({"max_rounds": 11}, "mcp.max_rounds"), ({"tools": "web"}, "mcp.tools")):
        r = _loop(base, mcp=mcp)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text
    r = _loop(base, mcp=True, n=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "mcp"
    r = httpx.post(f"{base}/v1/responses", headers=AUTH, json={"model": "tiny-llama", "input": "hi", "mcp": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mcp"


def test_the_tool_loop_streams_each_rounds_text_and_the_messages_it_added(mcp_server) -> None:
    base = mcp_server[0].base_url
    _wait_ready(base, ["local", "web"])
    payload = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Pick a color."}], "max_tokens": 80,
               "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
               "mcp": {"tools": ["local__pick"], "max_rounds": 2},
               "tool_choice": {"type": "function", "function": {"name": "local__pick"}}}
    whole = httpx.post(f"{base}/v1/chat/completions", json={**payload, "stream": False}, headers=AUTH, timeout=240)
    rounds = whole.json()["mcp"]["rounds"]  # greedy: the stream's rounds are these
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=payload, headers=AUTH, timeout=240) as r:
        assert r.status_code == 200
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    assert not any("error" in c for c in chunks), chunks
    ran = [c["mcp"]["messages"] for c in chunks if "mcp" in c]
    assert len(ran) == 1 and ran[0][0]["tool_calls"][0]["function"]["name"] == "local__pick"
    assert ran[0][1]["role"] == "tool" and ran[0][1]["content"].startswith("picked ")
    deltas = [ch["delta"] for c in chunks for ch in c["choices"]]
    assert not any("tool_calls" in d for d in deltas)  # the round the server ran is not the client's to run
    finish = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finish == ["length"] or finish == ["stop"], finish
    usage = chunks[-1]["usage"]
    assert len(rounds) == 2 and usage["completion_tokens"] == sum(x["completion_tokens"] for x in rounds)
    assert usage["prompt_tokens"] == sum(x["prompt_tokens"] for x in rounds)


def test_a_malformed_config_stops_the_start_with_a_message(tmp_path: Path) -> None:
    config = tmp_path / "mcp.yaml"
    config.write_text("servers:\n  - name: x\n    transport: carrier-pigeon\n")
    proc = subprocess.run([sys.executable, "-m", "omlx", "serve", "--mcp-config", str(config),
                           "--port", str(free_port())], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "OMLX_HOME": str(tmp_path / "home")})
    assert proc.returncode == 2
    assert "servers.0.transport" in proc.stderr and "carrier-pigeon" in proc.stderr


def test_the_tool_loop_on_messages_through_the_anthropic_sdk(mcp_server) -> None:
    import anthropic

    base = mcp_server[0].base_url
    _wait_ready(base, ["local", "web"])
    claude = anthropic.Anthropic(base_url=base, api_key=KEY)
    msg = claude.messages.create(model="tiny-llama", max_tokens=80,
                                 messages=[{"role": "user", "content": "Pick a color."}],
                                 tool_choice={"type": "tool", "name": "web__pick"},
                                 extra_body={"temperature": 0, "mcp": {"tools": ["web__pick"], "max_rounds": 2}})
    extra = msg.model_extra["mcp"]
    assert len(extra["rounds"]) == 2
    call, results = extra["messages"]
    use = call["content"][-1]
    assert call["role"] == "assistant" and use["type"] == "tool_use" and use["name"] == "web__pick"
    assert results["role"] == "user" and results["content"][0]["tool_use_id"] == use["id"]
    assert results["content"][0]["content"].startswith(f"picked {use['input']['color']} at ")
    assert msg.usage.output_tokens == sum(r["completion_tokens"] for r in extra["rounds"])
    assert msg.usage.cache_read_input_tokens >= extra["rounds"][0]["prompt_tokens"] - 16
    # streaming: the SDK skips the mcp event and reads the rest
    with claude.messages.stream(model="tiny-llama", max_tokens=80,
                                messages=[{"role": "user", "content": "Pick a color."}],
                                tool_choice={"type": "tool", "name": "web__pick"},
                                extra_body={"temperature": 0, "mcp": {"tools": ["web__pick"], "max_rounds": 2}}) as stream:
        final = stream.get_final_message()
    assert not [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.output_tokens == sum(r["completion_tokens"] for r in extra["rounds"])  # greedy: the same
    payload = {"model": "tiny-llama", "max_tokens": 80, "temperature": 0, "stream": True,
               "messages": [{"role": "user", "content": "Pick a color."}],
               "tool_choice": {"type": "tool", "name": "web__pick"}, "mcp": {"tools": ["web"], "max_rounds": 2}}
    with httpx.stream("POST", f"{base}/v1/messages", json=payload, headers={"x-api-key": KEY}, timeout=120) as r:
        kinds = [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds[0] == "message_start" and kinds.count("mcp") == 1 and kinds[-1] == "message_stop"
    too_long = httpx.post(f"{base}/v1/messages", headers={"x-api-key": KEY}, timeout=60, json={
        **payload, "messages": [{"role": "user", "content": "word " * 3000}]})
    assert too_long.status_code == 400 and too_long.json()["type"] == "error"  # before the stream starts
