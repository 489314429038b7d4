"""OpenAI Responses API wire models, input-item conversion and the bounded response store."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from typing import Any

from pydantic import Field

from omlx.api.chat_template import content_text
from omlx.api.media import MediaPolicy
from omlx.api.tool_specs import checked_choice, function_spec, tool_list, tool_name, unique
from omlx.api.wire import Lenient, Temperature, TopP
from omlx.errors import InvalidRequestError

log = logging.getLogger("omlx.api")


class ResponsesRequest(Lenient):
    model: str
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: Temperature = None
    top_p: TopP = None
    stream: bool = False
    store: bool = True
    reasoning: dict[str, Any] | None = None
    # reasoning tokens before the model's end-of-thinking marker is forced (oMLX's own field)
    thinking_budget: int | None = Field(default=None, ge=0)
    text: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value)


def _call_arguments(value: Any, param: str) -> dict[str, Any]:
    """A `function_call` item's arguments: a JSON string (one that does not parse is kept raw)."""
    if value is None or value == "":
        return {}
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise InvalidRequestError(f"{param} must be a JSON string, got {type(value).__name__}.", param=param)
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return {"_raw": value}


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its `reasoning_text` content (what this server returns), else its
    summary; encrypted content is opaque and left out."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list):
            text = "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
            if text:
                return text
    return ""


def items_to_messages(items: list[dict[str, Any]], media: MediaPolicy) -> list[dict[str, Any]]:
    """Responses input/output items → HF chat messages: calls attach to their assistant turn, and
    a `reasoning` item is the `reasoning_content` of the turn it opens (so templates that keep
    reasoning render the turn as it was generated)."""
    out: list[dict[str, Any]] = []
    reasoning: list[str] = []  # of the assistant turn the next assistant item opens
    for i, item in enumerate(items):
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role", "user")
            role = "system" if role == "developer" else role
            if role not in ("system", "user", "assistant"):
                raise InvalidRequestError(f"input.{i}.role {json.dumps(role)[:40]} is not supported.", param=f"input.{i}.role")
            msg: dict[str, Any] = {"role": role, "content": content_text(item.get("content"), f"input.{i}.content", media)}
            if role == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = "".join(reasoning), []
            out.append(msg)
        elif kind == "function_call":
            args = _call_arguments(item.get("arguments"), f"input.{i}.arguments")
            name = tool_name(item.get("name"), f"input.{i}.name")
            call = {"id": item.get("call_id"), "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant" and not reasoning:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if reasoning:
                    out[-1]["reasoning_content"], reasoning = "".join(reasoning), []
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else content_text(output, f"input.{i}.output", media, in_tool_result=True)
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            reasoning.append(_reasoning_text(item))
        else:
            log.info("ignoring Responses input item of type %r", kind)
    return out


def _function_specs(tools: Any, param: str) -> list[dict[str, Any]]:
    specs: list[dict[str, Any]] = []
    for i, tool in enumerate(tool_list(tools, param)):
        kind = tool.get("type")
        if kind == "function":
            specs.append(function_spec(tool, f"{param}.{i}"))
        elif kind == "namespace":
            specs += _function_specs(tool.get("tools"), f"{param}.{i}.tools")
        else:
            log.info("ignoring Responses tool of type %r (not supported locally)", kind)
    return specs


def function_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Function tools (also inside `namespace` groups), checked; built-in tools are ignored
    and logged."""
    return unique(_function_specs(tools, "tools"), "tools")


def tool_choice_name(choice: str | dict[str, Any] | None, specs: list[dict[str, Any]] | None) -> str | None:
    if choice is None:
        return None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError(f"tool_choice must be 'none', 'auto', 'required' or an object, got {choice[:40]!r}.",
                                      param="tool_choice")
        return choice
    if choice.get("type") == "function":
        return checked_choice(tool_name(choice.get("name"), "tool_choice.name"), specs, "tool_choice")
    return None  # built-in tool choices: the model chooses


class ResponseStore:
    """Stored responses for `previous_response_id`, bounded by count and age."""

    def __init__(self, max_items: int = 1000, max_age_s: float = 3600.0):
        self.max_items = max_items
        self.max_age_s = max_age_s
        self._items: OrderedDict[str, tuple[float, dict[str, Any], list[dict[str, Any]]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[response["id"]] = (time.time(), response, conversation)
            self._prune()

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        with self._lock:
            self._prune()
            found = self._items.get(response_id)
            return None if found is None else (found[1], found[2])

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)

    def _prune(self) -> None:
        cutoff = time.time() - self.max_age_s
        while self._items and (len(self._items) > self.max_items or next(iter(self._items.values()))[0] < cutoff):
            self._items.popitem(last=False)
