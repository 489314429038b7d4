"""Anthropic Messages wire models and their conversion to HF chat messages.

Lenient by design: real clients (Claude Code) send cache_control markers,
adaptive thinking, output_config, context_management and more; unknown fields
are ignored.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from omlx.errors import InvalidRequestError


class Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class AnthropicMessage(Lenient):
    role: str
    content: str | list[dict[str, Any]]


class MessagesRequest(Lenient):
    model: str
    messages: list[AnthropicMessage]
    max_tokens: int | None = Field(default=None, ge=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class CountTokensRequest(Lenient):
    model: str
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


def _text_of(blocks: str | list[dict[str, Any]] | None, where: str) -> str:
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    out = []
    for b in blocks:
        kind = b.get("type")
        if kind == "text":
            out.append(str(b.get("text", "")))
        elif kind in ("image", "document"):
            raise InvalidRequestError(f"{where}: '{kind}' blocks are not supported by this text model.")
    return "\n".join(out) if len(out) > 1 and where.startswith("system") else "".join(out)


def to_chat_messages(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """Anthropic system + messages → HF chat-template messages."""
    out: list[dict[str, Any]] = []
    system = _text_of(req.system, "system")
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        if m.role == "system":  # seen mid-conversation from real clients
            out.append({"role": "system", "content": _text_of(m.content, where)})
            continue
        if m.role not in ("user", "assistant"):
            raise InvalidRequestError(f"{where}.role must be 'user' or 'assistant', got '{m.role}'.")
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text: list[str] = []
        thinking: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(m.content):
            kind = block.get("type")
            if kind == "text":
                text.append(str(block.get("text", "")))
            elif kind in ("thinking", "redacted_thinking"):
                thinking.append(str(block.get("thinking", "")))
            elif kind == "tool_use":
                args = block.get("input") or {}
                calls.append({"id": block.get("id"), "type": "function",
                              "function": {"name": block.get("name"), "arguments": args}})
            elif kind == "tool_result":
                if text:  # keep the order: text said before the result
                    out.append({"role": m.role, "content": "".join(text)})
                    text = []
                result = _text_of(block.get("content"), f"{where}.content.{j}")
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
            elif kind in ("image", "document"):
                raise InvalidRequestError(f"{where}.content.{j}: '{kind}' blocks are not supported by this text model.")
        if text or calls or thinking or not m.content:
            msg: dict[str, Any] = {"role": m.role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = "".join(thinking)
            out.append(msg)
    return out


def tool_specs(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic tools → function specs; server tools (web search …) are skipped."""
    specs = []
    for t in tools or []:
        if "input_schema" in t or t.get("type") in (None, "custom"):
            specs.append({"name": t["name"], "description": t.get("description", ""),
                          "parameters": t.get("input_schema") or {"type": "object", "properties": {}}})
    return specs or None


def tool_choice_name(choice: dict[str, Any] | None) -> str | None:
    if not choice:
        return None
    kind = choice.get("type")
    if kind == "tool":
        return choice.get("name")
    return {"auto": "auto", "any": "required", "none": "none"}.get(kind)


def thinking_kwargs(thinking: dict[str, Any] | None) -> dict[str, Any]:
    """enabled/adaptive → enable_thinking True, disabled → False, absent → the template's default."""
    if not thinking:
        return {}
    kind = thinking.get("type")
    if kind in ("enabled", "adaptive"):
        return {"enable_thinking": True}
    if kind == "disabled":
        return {"enable_thinking": False}
    return {}


def tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {"_raw": arguments}
    return value if isinstance(value, dict) else {"value": value}
