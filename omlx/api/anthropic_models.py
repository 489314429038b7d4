"""Anthropic Messages wire models and their conversion to HF chat messages.

Lenient by design: real clients (Claude Code) send cache_control markers,
adaptive thinking, output_config, context_management and more; unknown fields
are ignored.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, StrictBool

from omlx.api.media import MediaPolicy
from omlx.api.tool_specs import checked_choice, function_spec, tool_list, tool_name, unique
from omlx.api.wire import Lenient, StopList, Temperature, TopK, TopP
from omlx.errors import InvalidRequestError


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
    stop_sequences: StopList = None
    temperature: Temperature = None
    top_p: TopP = None
    top_k: TopK = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's older field
    # the server runs the MCP tools the model calls (oMLX's own field: omlx/server/mcp_loop.py)
    mcp: StrictBool | dict[str, Any] | None = None


class CountTokensRequest(Lenient):
    model: str
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


# Blocks of Anthropic's own server tools (web search, MCP connector, code execution …) carry
# nothing a local model can use: accepted and left out, as are `search_result` blocks.
SKIPPED_KINDS = ("server_tool_use", "mcp_tool_use", "search_result", "container_upload")
TURN_KINDS = ("text", "thinking", "redacted_thinking", "tool_use", "tool_result")


def _skipped(kind: str) -> bool:
    return kind in SKIPPED_KINDS or (kind.endswith("_tool_result") and kind != "tool_result")


def _refuse(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message}", param=param)


def _block_text(block: dict[str, Any], param: str, key: str = "text") -> str:
    value = block.get(key, "")
    if not isinstance(value, str):
        raise _refuse(f"'{key}' must be a string, got {type(value).__name__}.", f"{param}.{key}")
    return value


def _blocks(value: Any, param: str) -> list[dict[str, Any]]:
    """Content blocks: each an object with a string `type` (any type: unknown ones are dropped)."""
    if not isinstance(value, list):
        raise _refuse(f"must be a string or a list of content blocks, got {type(value).__name__}.", param)
    for j, block in enumerate(value):
        if not isinstance(block, dict):
            raise _refuse(f"each content block must be an object, got {type(block).__name__}.", f"{param}.{j}")
        if not isinstance(block.get("type"), str):
            raise _refuse("each content block needs a 'type' string.", f"{param}.{j}.type")
    return value


def _document_text(block: dict[str, Any]) -> str | None:
    """A document's text when it carries text (a plain-text or content source), else None."""
    source = block.get("source")
    if not isinstance(source, dict):
        return None
    if source.get("type") == "text" and isinstance(source.get("data"), str):
        return source["data"]
    if source.get("type") == "content" and isinstance(source.get("content"), (str, list)):
        content = source["content"]
        if isinstance(content, str):
            return content
        return "".join(b.get("text", "") for b in content if isinstance(b, dict) and isinstance(b.get("text"), str))
    return None


def _text_of(blocks: Any, where: str, media: MediaPolicy, in_tool_result: bool = False) -> str:
    """The text of a string or of content blocks (system prompts, tool results): media inside a
    tool result becomes a placeholder, at the top level a 400 (`MediaPolicy`)."""
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    out = []
    for j, b in enumerate(_blocks(blocks, where)):
        kind, param = b["type"], f"{where}.{j}"
        if kind == "text":
            out.append(_block_text(b, param))
        elif kind == "image":
            out.append(media.image(kind, b, param, in_tool_result))
        elif kind == "document":
            text = _document_text(b)
            if text is not None:
                out.append(text)
            elif in_tool_result:
                out.append(media.placeholder(kind, param))
            else:
                raise media.refuse(kind, param)
        elif kind in TURN_KINDS:
            raise _refuse(f"'{kind}' blocks cannot appear here; use text blocks.", param)
        elif not _skipped(kind):
            media.drop(kind, param)
    return "\n".join(out) if len(out) > 1 and where.startswith("system") else "".join(out)


def _tool_use(block: dict[str, Any], param: str) -> dict[str, Any]:
    args = block.get("input", {})
    if not isinstance(args, dict):
        raise _refuse(f"'input' must be an object, got {type(args).__name__}.", f"{param}.input")
    name = tool_name(block.get("name"), f"{param}.name")
    return {"id": block.get("id"), "type": "function", "function": {"name": name, "arguments": args}}


def to_chat_messages(req: MessagesRequest | CountTokensRequest, media: MediaPolicy | None = None) -> list[dict[str, Any]]:
    """Anthropic system + messages → HF chat-template messages (`media` collects the warnings)."""
    media = media or MediaPolicy(req.model)
    out: list[dict[str, Any]] = []
    system = _text_of(req.system, "system", media)
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        if m.role == "system":  # seen mid-conversation from real clients
            out.append({"role": "system", "content": _text_of(m.content, f"{where}.content", media)})
            continue
        if m.role not in ("user", "assistant"):
            raise _refuse(f"role must be 'user' or 'assistant', got {m.role[:40]!r}.", f"{where}.role")
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text: list[str] = []
        thinking: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(_blocks(m.content, f"{where}.content")):
            kind, param = block["type"], f"{where}.content.{j}"
            if kind == "text":
                text.append(_block_text(block, param))
            elif kind in ("thinking", "redacted_thinking"):
                thinking.append(_block_text(block, param, "thinking"))
            elif kind == "tool_use":
                calls.append(_tool_use(block, param))
            elif kind == "tool_result":
                if text:  # keep the order: text said before the result
                    out.append({"role": m.role, "content": "".join(text)})
                    text = []
                result = _text_of(block.get("content"), f"{param}.content", media, in_tool_result=True)
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
            elif kind == "image":
                text.append(media.image(kind, block, param, in_tool_result=False))
            elif kind == "document":
                document = _document_text(block)
                if document is None:
                    raise media.refuse(kind, param)
                text.append(document)
            elif not _skipped(kind):
                media.drop(kind, param)
        if text or calls or thinking or not m.content:
            msg: dict[str, Any] = {"role": m.role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = "".join(thinking)
            out.append(msg)
    return out


def tool_specs(tools: Any) -> list[dict[str, Any]] | None:
    """Anthropic tools → function specs; server tools (web search …, typed and named by
    Anthropic) are skipped."""
    specs = []
    for i, t in enumerate(tool_list(tools, "tools")):
        if "input_schema" in t or t.get("type") in (None, "custom"):
            specs.append(function_spec(t, f"tools.{i}", schema_key="input_schema"))
    return unique(specs, "tools")


def tool_choice_name(choice: dict[str, Any] | None, specs: list[dict[str, Any]] | None) -> str | None:
    """auto → 'auto', any → 'required', none → 'none', tool → its name (a declared tool)."""
    if not choice:
        return None
    kind = choice.get("type")
    if kind == "tool":
        return checked_choice(tool_name(choice.get("name"), "tool_choice.name"), specs, "tool_choice")
    if kind not in ("auto", "any", "none"):
        raise _refuse(f"type must be 'auto', 'any', 'tool' or 'none', got {json.dumps(kind)[:40]}.", "tool_choice.type")
    return {"auto": "auto", "any": "required", "none": "none"}[kind]


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


def thinking_budget(thinking: dict[str, Any] | None) -> int | None:
    """`thinking.budget_tokens` of enabled thinking (None: no budget)."""
    if not thinking or thinking.get("type") != "enabled" or thinking.get("budget_tokens") is None:
        return None
    budget = thinking["budget_tokens"]
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise _refuse(f"must be a non-negative integer, got {json.dumps(budget)[:40]}.", "thinking.budget_tokens")
    return budget

