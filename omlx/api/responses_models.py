"""OpenAI Responses API wire models, input-item conversion and the bounded response store."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from omlx.api.chat_template import content_text
from omlx.errors import InvalidRequestError

log = logging.getLogger("omlx.api")


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: str
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None


def input_items(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    return list(value)


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input/output items → HF chat messages (calls attach to the assistant turn)."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role", "user")
            role = "system" if role == "developer" else role
            if role not in ("system", "user", "assistant"):
                raise InvalidRequestError(f"input.{i}.role '{role}' is not supported.", param=f"input.{i}.role")
            out.append({"role": role, "content": content_text(item.get("content"), f"input.{i}.content")})
        elif kind == "function_call":
            try:
                args = json.loads(item.get("arguments") or "{}")
            except json.JSONDecodeError:
                args = {"_raw": item.get("arguments")}
            call = {"id": item.get("call_id"), "type": "function", "function": {"name": item.get("name"), "arguments": args}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else content_text(output, f"input.{i}.output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            continue  # earlier reasoning is not replayed
        else:
            log.info("ignoring Responses input item of type %r", kind)
    return out


def function_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools (also inside `namespace` groups); built-in tools are ignored and logged."""
    specs: list[dict[str, Any]] = []
    for tool in tools or []:
        kind = tool.get("type")
        if kind == "function":
            specs.append({"name": tool["name"], "description": tool.get("description", ""),
                          "parameters": tool.get("parameters") or {"type": "object", "properties": {}}})
        elif kind == "namespace":
            specs += function_tools(tool.get("tools")) or []
        else:
            log.info("ignoring Responses tool of type %r (not supported locally)", kind)
    return specs or None


def tool_choice_name(choice: str | dict[str, Any] | None) -> str | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function":
        return choice.get("name")
    return None


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
