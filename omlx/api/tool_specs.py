"""Tool declarations and tool choices of every dialect, checked and turned into one form:
`{"name", "description", "parameters"}` with `parameters` a valid JSON schema.

A malformed tool is refused with a 400 naming the field (`tools.2.function.parameters`), never
rendered into a prompt or passed to a chat template.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from jsonschema import Draft202012Validator, SchemaError, validators

from omlx.errors import InvalidRequestError

# OpenAI allows [a-zA-Z0-9_-]{1,64}; MCP and namespaced tools also use '.' and ':'.
_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
EMPTY_OBJECT = {"type": "object", "properties": {}}


def _refuse(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message}", param=param)


def tool_name(value: Any, param: str) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        shown = json.dumps(value)[:80] if value is not None else "missing"
        raise _refuse(
            f"a tool name must be 1-128 letters, digits or '_', '-', '.', ':' (got {shown}).", param
        )
    return value


@functools.lru_cache(maxsize=1024)
def _schema_error(text: str) -> str | None:
    """Why a JSON schema (as canonical JSON text) is not valid, or None; cached, since agents
    send the same tools every turn."""
    schema = json.loads(text)
    try:
        validators.validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        return f"{exc.message}" + (f" (at '{where}')" if where else "")
    return None


def json_schema(value: Any, param: str) -> dict[str, Any]:
    """A tool's parameter schema: absent means an object with no properties."""
    if value is None:
        return dict(EMPTY_OBJECT)
    if not isinstance(value, dict):
        raise _refuse(f"must be a JSON schema object, got {type(value).__name__}.", param)
    error = _schema_error(json.dumps(value, sort_keys=True))
    if error is not None:
        raise _refuse(f"not a valid JSON schema: {error}.", param)
    return value


def function_spec(fields: Any, param: str, *, schema_key: str = "parameters") -> dict[str, Any]:
    """One function tool's `{"name", "description", "parameters"}` (and `"strict": True` for a
    strict one) from an object of the caller's dialect holding `name`, `description` and
    `schema_key`."""
    if not isinstance(fields, dict):
        raise _refuse(f"must be an object, got {type(fields).__name__}.", param)
    description = fields.get("description")
    if description is not None and not isinstance(description, str):
        raise _refuse("description must be a string.", f"{param}.description")
    spec = {
        "name": tool_name(fields.get("name"), f"{param}.name"),
        "description": description or "",
        "parameters": json_schema(fields.get(schema_key), f"{param}.{schema_key}"),
    }
    if fields.get("strict") is True:  # its calls' arguments are held to the schema
        spec["strict"] = True
    return spec


def tool_list(value: Any, param: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _refuse(f"must be a list of tools, got {type(value).__name__}.", param)
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise _refuse(f"each tool must be an object, got {type(tool).__name__}.", f"{param}.{i}")
    return value


def unique(specs: list[dict[str, Any]], param: str) -> list[dict[str, Any]] | None:
    names = [s["name"] for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise _refuse(f"tool names must be unique; declared more than once: {', '.join(twice)}.", param)
    return specs or None


def openai_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Chat completions' `[{"type": "function", "function": {...}}]`."""
    specs = []
    for i, tool in enumerate(tool_list(tools, "tools")):
        kind = tool.get("type", "function")
        if kind != "function":
            raise _refuse(f"tool type {json.dumps(kind)[:40]} is not supported; use 'function'.", f"tools.{i}.type")
        specs.append(function_spec(tool.get("function"), f"tools.{i}.function"))
    return unique(specs, "tools")


def checked_choice(name: str | None, specs: list[dict[str, Any]] | None, param: str) -> str | None:
    """A named tool choice must name a declared tool."""
    if name in (None, "auto", "none", "required"):
        return name
    if not any(s["name"] == name for s in specs or []):
        raise _refuse(f"names the tool '{name}', which is not among the declared tools.", param)
    return name


def openai_tool_choice(choice: Any, specs: list[dict[str, Any]] | None) -> str | None:
    """'none' | 'auto' | 'required' | {"type": "function", "function": {"name": ...}}."""
    if choice is None:
        return None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _refuse(f"must be 'none', 'auto', 'required' or a function object, got {choice[:40]!r}.", "tool_choice")
        return choice
    if not isinstance(choice, dict) or choice.get("type", "function") != "function":
        raise _refuse("must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}.",
                      "tool_choice")
    function = choice.get("function")
    if not isinstance(function, dict):
        raise _refuse("function must be an object with the tool's name.", "tool_choice.function")
    return checked_choice(tool_name(function.get("name"), "tool_choice.function.name"), specs, "tool_choice")
