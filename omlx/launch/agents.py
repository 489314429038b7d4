"""What each coding agent needs to talk to an oMLX server: environment variables, command-line
flags and, for OpenCode, a config file of our own. Nothing here touches the user's own
configuration files; docs/agents.md says why each value is what it is."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

AGENTS = {"claude": "claude", "codex": "codex", "opencode": "opencode"}  # agent → its executable
INSTALL = {
    "claude": "npm install -g @anthropic-ai/claude-code",
    "codex": "npm install -g @openai/codex",
    "opencode": "npm install -g opencode-ai",
}
# Claude Code drops a stream that carried no content for max(CLAUDE_STREAM_IDLE_TIMEOUT_MS,
# 300000) ms, capped at 1800000 (pings do not count); API_FORCE_IDLE_TIMEOUT=0 lifts the limit.
CLAUDE_IDLE_MS = 1_800_000
SLOW_DEVICE_TIMEOUT_MS = 3_600_000  # one request's limit where a long prefill takes many minutes


@dataclass
class ServerInfo:
    """The server an agent is pointed at, and the model it uses there."""

    url: str  # http://host:port, no trailing slash
    model: str
    context_length: int
    api_key: str | None = None
    max_output_tokens: int | None = None  # the model's max_tokens_cap, if it has one
    slow_device: bool = False  # a CPU: first prefills of agent prompts take many minutes


@dataclass
class LaunchPlan:
    agent: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)  # set for the agent's process
    unset: list[str] = field(default_factory=list)  # removed from the agent's environment
    files: dict[Path, str] = field(default_factory=dict)  # written before the agent starts (ours)
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """What `--print-config` shows: every variable, flag and file (keys masked)."""
        lines = [f"# {self.agent}: what `omlx launch {self.agent}` sets", "", "environment:"]
        for key, value in sorted(self.env.items()):
            shown = "***" if ("KEY" in key or "TOKEN" in key) and value not in ("omlx", "") else value
            lines.append(f"  {key}={shown}")
        lines += [f"  (unset) {key}" for key in self.unset]
        for path, text in self.files.items():
            lines += ["", f"file {path} (written by oMLX, not one of yours):", text.rstrip()]
        lines += ["", "command:", "  " + " ".join(_quote(a) for a in self.command)]
        lines += ["", *[f"note: {n}" for n in self.notes]] if self.notes else []
        return "\n".join(lines)


def _quote(arg: str) -> str:
    return arg if arg and all(c.isalnum() or c in "-_./=:@," for c in arg) else "'" + arg.replace("'", "'\\''") + "'"


def claude_plan(server: ServerInfo, args: list[str]) -> LaunchPlan:
    """Claude Code: the Anthropic Messages API at the server, every model role on one model."""
    env = {
        "ANTHROPIC_BASE_URL": server.url,
        "ANTHROPIC_AUTH_TOKEN": server.api_key or "omlx",
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(CLAUDE_IDLE_MS),
        # the model's real window (Claude Code assumes 1M tokens for a model it does not know);
        # its auto-compaction needs windows of 100k+ and would loop on a local model's 32k
        "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(server.context_length),
        "DISABLE_AUTO_COMPACT": "1",
        "API_TIMEOUT_MS": str(SLOW_DEVICE_TIMEOUT_MS if server.slow_device else CLAUDE_IDLE_MS),
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    for role in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                 "ANTHROPIC_DEFAULT_HAIKU_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL"):
        env[role] = server.model
    if server.max_output_tokens:
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(server.max_output_tokens)
    notes = ["Claude Code drops a stream that carries no content for its idle limit (pings do not count): "
             f"set to its maximum, {CLAUDE_IDLE_MS} ms."]
    if server.slow_device:
        env["API_FORCE_IDLE_TIMEOUT"] = "0"
        notes.append("On a CPU the first prefill of Claude Code's prompt can outlast even that: "
                     "API_FORCE_IDLE_TIMEOUT=0 lifts the idle limit.")
    return LaunchPlan("claude", [AGENTS["claude"], *args], env, ["ANTHROPIC_API_KEY"], notes=notes)


def codex_args(server: ServerInfo) -> list[str]:
    """`-c` overrides (Codex's own flag; ~/.codex/config.toml is left as it is)."""
    idle = SLOW_DEVICE_TIMEOUT_MS if server.slow_device else 600_000
    pairs = {
        "model_provider": '"omlx"',
        "model": json.dumps(server.model),
        "model_providers.omlx.name": '"oMLX"',
        "model_providers.omlx.base_url": json.dumps(server.url + "/v1"),
        "model_providers.omlx.wire_api": '"responses"',
        "model_providers.omlx.stream_idle_timeout_ms": str(idle),
        "model_providers.omlx.request_max_retries": "1",
        "model_providers.omlx.stream_max_retries": "1",
        "model_context_window": str(server.context_length),
        "check_for_update_on_startup": "false",
        "analytics.enabled": "false",
    }
    if server.api_key:
        pairs["model_providers.omlx.env_key"] = '"OMLX_API_KEY"'
    return [arg for key, value in pairs.items() for arg in ("-c", f"{key}={value}")]


def codex_plan(server: ServerInfo, args: list[str]) -> LaunchPlan:
    """Codex: a provider of its own for the server's Responses API, with a longer stream timeout."""
    env = {"OMLX_API_KEY": server.api_key} if server.api_key else {}
    notes = ["Codex drops a stream that sends no event for `stream_idle_timeout_ms` (300000 ms by default; "
             "keep-alive comments do not count): raised for this provider."]
    return LaunchPlan("codex", [AGENTS["codex"], *codex_args(server), *args], env, notes=notes)


def opencode_config(server: ServerInfo) -> dict:
    output = server.max_output_tokens or min(32_000, server.context_length // 4)
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"omlx": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "oMLX",
            "options": {"baseURL": server.url + "/v1", "apiKey": server.api_key or "omlx", "timeout": False},
            "models": {server.model: {"name": server.model, "tool_call": True,
                                      "limit": {"context": server.context_length, "output": output}}},
        }},
        "model": f"omlx/{server.model}",
        "small_model": f"omlx/{server.model}",
        "autoupdate": False,
        "share": "disabled",
    }  # fmt: skip


def opencode_plan(server: ServerInfo, args: list[str], home: Path) -> LaunchPlan:
    """OpenCode: an openai-compatible provider in a config file of ours (OPENCODE_CONFIG), which
    OpenCode merges over the user's own."""
    path = home / "launch" / "opencode.json"
    env = {
        "OPENCODE_CONFIG": str(path),
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_SHARE": "1",
    }
    notes = ["OpenCode's provider timeout is off (`timeout: false`): a long prefill is not cut short."]
    text = json.dumps(opencode_config(server), indent=2) + "\n"
    return LaunchPlan("opencode", [AGENTS["opencode"], *args], env, files={path: text}, notes=notes)


def plan_for(agent: str, server: ServerInfo, args: list[str], home: Path) -> LaunchPlan:
    if agent == "claude":
        return claude_plan(server, args)
    if agent == "codex":
        return codex_plan(server, args)
    if agent == "opencode":
        return opencode_plan(server, args, home)
    raise ValueError(f"unknown agent {agent!r}; choose one of {', '.join(AGENTS)}")
