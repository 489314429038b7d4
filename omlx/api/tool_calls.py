"""What the output parser emits (text, reasoning and tool-call deltas) and the helpers that
normalize offered tools and call arguments into the OpenAI shape every API uses."""

from __future__ import annotations

import ast
import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Delta", "OutputWarning", "ReasoningDelta", "TextDelta", "ToolCall", "new_call_id", "normalize_arguments",
    "call_arguments", "normalize_tools", "tool_names", "calls_from_json", "json_values",
]  # fmt: skip


# --------------------------------------------------------------------------- deltas


@dataclass
class TextDelta:
    text: str


@dataclass
class ReasoningDelta:
    text: str


@dataclass
class ToolCall:
    """One call. `arguments` is the text of a JSON object ("{}" when there are none), or, when
    `problem` says why it is not one, the arguments as the model generated them."""

    id: str
    name: str
    arguments: str
    model_id: str | None = field(default=None, compare=False)  # the id the model printed, if any
    problem: str | None = field(default=None, compare=False)  # why `arguments` is not a JSON object


Delta = TextDelta | ReasoningDelta | ToolCall


@dataclass(frozen=True)
class OutputWarning:
    """Something in the output that could not be read as the model meant it; every API returns
    these in its response's `warnings` (docs/agents.md)."""

    # tool_call_unclosed | tool_call_unparsed | tool_call_unknown_tool | tool_arguments_invalid | media_omitted
    code: str
    message: str

    def as_json(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# --------------------------------------------------------------------------- tools and arguments


def normalize_tools(tools: Iterable[dict] | None) -> list[dict]:
    """Tools in the OpenAI chat shape ``{"type": "function", "function": {name, description, parameters}}``.

    Accepts that shape, the flat Responses shape ``{"type": "function", "name": …, "parameters": …}``
    and the Anthropic shape ``{"name": …, "input_schema": …}``. Entries without a name are skipped.
    """
    out = []
    for tool in tools or []:
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            continue
        params = fn.get("parameters")
        if params is None:
            params = fn.get("input_schema")
        spec: dict[str, Any] = {"name": name}
        if fn.get("description"):
            spec["description"] = fn["description"]
        spec["parameters"] = (
            params if isinstance(params, dict) else {"type": "object", "properties": {}}
        )
        out.append({"type": "function", "function": spec})
    return out


def tool_names(tools: Iterable[dict] | None) -> set[str]:
    return {t["function"]["name"] for t in normalize_tools(tools)}


def _dump_object(value: dict) -> tuple[str, str | None]:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, default=str), None
    except (TypeError, ValueError):  # NaN/inf, non-string keys
        return str(value), "arguments hold values JSON cannot carry (NaN, infinity or non-string keys)"


def _kind(value: Any) -> str:
    return {str: "a string", list: "a list", bool: "a boolean"}.get(type(value), "a number")


def call_arguments(value: Any) -> tuple[str, str | None]:
    """A call's arguments as the text of a JSON object, and None; or, when they are not one, the
    arguments as generated and what is wrong with them (the client's validation tells the model).

    Repaired on the way: arguments JSON-encoded twice, Python dict literals (``{'a': 1}``)."""
    if value is None:
        return "{}", None
    if isinstance(value, dict):
        return _dump_object(value)
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return "{}", None
        decoded: Any = text
        error = ""
        for _ in range(2):  # arguments sometimes arrive JSON-encoded twice
            try:
                decoded = json.loads(decoded)
            except (ValueError, RecursionError) as exc:
                error = str(exc)
                decoded = _python_literal(decoded)
                if decoded is None:
                    return text, f"arguments are not valid JSON ({error})"
            if not isinstance(decoded, str):
                break
        if decoded is None:
            return "{}", None
        if isinstance(decoded, dict):
            return _dump_object(decoded)
        return text, f"arguments are {_kind(decoded)}, not a JSON object"
    try:
        return json.dumps(value, ensure_ascii=False, default=str), f"arguments are {_kind(value)}, not a JSON object"
    except (TypeError, ValueError):
        return str(value), "arguments are not a JSON object"


def normalize_arguments(value: Any) -> str:
    """The arguments' text (see :func:`call_arguments`)."""
    return call_arguments(value)[0]


def _python_literal(text: str) -> Any:
    """A Python dict/list literal (small models print ``{'x': 1}``), else None."""
    if not isinstance(text, str) or text.lstrip()[:1] not in ("{", "["):
        return None
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


def _looks_like_schema(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and value.get("type") == "object"
        and isinstance(value.get("properties"), dict)
    )


def _call_from_dict(d: Any) -> dict | None:
    """``{"name", "arguments"|"parameters", "id"?}`` or ``{"function": {"name", "arguments"}}``."""
    if not isinstance(d, dict):
        return None
    fn = d.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("name"), str) and "arguments" in fn:
        name, args = fn["name"], fn.get("arguments")
    else:
        name = d.get("name")
        if not isinstance(name, str) and isinstance(fn, str):
            name = fn  # {"function": "f", "arguments": {...}}
        if not isinstance(name, str):
            return None
        if "arguments" in d:
            args = d["arguments"]
        elif "parameters" in d:
            args = d["parameters"]
            if "description" in d and _looks_like_schema(args):
                return None  # the model repeated a tool definition
        else:
            args = None
    if not name.strip():
        return None
    call = {"name": name.strip(), "arguments": args}
    if isinstance(d.get("id"), str):
        call["id"] = d["id"]
    return call


_STRICT_CALL_KEYS = {"name", "arguments", "parameters", "id", "type"}


def strict_call(d: Any) -> dict | None:
    """``{"name", "arguments"|"parameters", "id"?, "type"?}`` and nothing else, the arguments an
    object or a JSON string: a call beyond doubt, whatever the name; None otherwise."""
    if not isinstance(d, dict) or not set(d) <= _STRICT_CALL_KEYS or "name" not in d:
        return None
    if ("arguments" in d) == ("parameters" in d):
        return None
    args = d.get("arguments", d.get("parameters"))
    if not isinstance(args, (dict, str)):
        return None
    return _call_from_dict(d)


def calls_from_json(value: Any, known: set[str] | None) -> list[dict] | None:
    """Calls from a decoded JSON value (an object or a list of objects); None if it is not one."""
    items = value if isinstance(value, list) else [value]
    if not items:
        return None
    calls = []
    for item in items:
        call = _call_from_dict(item)
        if call is None or (known is not None and call["name"] not in known):
            return None
        calls.append(call)
    return calls


def json_values(text: str) -> list[Any]:
    """Decode one JSON value, or several separated by whitespace, ``;`` or ``,``."""
    text = text.strip()
    try:
        return [json.loads(text)]
    except ValueError:
        pass
    decoder = json.JSONDecoder()
    values, pos = [], 0
    try:
        while pos < len(text):
            if values and not text[pos:].strip("}] \t\r\n"):
                break  # a stray closing brace after the last value, a common small-model slip
            value, pos = decoder.raw_decode(text, pos)
            values.append(value)
            while pos < len(text) and (text[pos].isspace() or text[pos] in ";,"):
                pos += 1
    except ValueError:
        literal = _python_literal(text)
        if literal is None:
            raise
        return [literal]
    return values
