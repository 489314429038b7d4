"""OpenAI Responses output: parsed deltas → output items and the streaming events, in order;
the non-streaming response is the final one of the same sequence."""

from __future__ import annotations

import copy
import secrets
import time
from typing import Any

from omlx.api.responses_models import ResponsesRequest
from omlx.api.tool_calls import Delta, ReasoningDelta, TextDelta, ToolCall
from omlx.server.chat_pipeline import ChatFinal
from omlx.server.generation import omlx_usage

Event = tuple[str, dict[str, Any]]


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def response_usage(final: ChatFinal) -> dict[str, Any]:
    return {
        "input_tokens": final.prompt_tokens,
        "input_tokens_details": {"cached_tokens": final.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": final.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": final.prompt_tokens + final.completion_tokens,
        **omlx_usage(final.cache),
    }


class ResponseEvents:
    """One response: `start()`, `feed()` per batch of deltas, `finish(final)`, each giving
    (event name, payload) pairs; `output` holds the items, `final_response` the result. Pure."""

    def __init__(self, body: ResponsesRequest):
        self.id = new_id("resp")
        self.body = body
        self.created = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.calls: list[ToolCall] = []
        self.final_response: dict[str, Any] | None = None
        self._seq = 0
        self._current: dict[str, Any] | None = None  # the open message or reasoning item

    def envelope(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": b.model, "output": self.output, "instructions": b.instructions,
            "previous_response_id": b.previous_response_id, "max_output_tokens": b.max_output_tokens,
            "temperature": b.temperature, "top_p": b.top_p, "tools": b.tools or [],
            "tool_choice": b.tool_choice or "auto", "parallel_tool_calls": True, "store": b.store,
            "metadata": b.metadata or {}, "usage": usage, "error": None, "incomplete_details": None,
            "text": self.text_config(), "reasoning": b.reasoning or {"effort": None, "summary": None},
        }  # fmt: skip

    def text_config(self) -> dict[str, Any]:
        """The `text` configuration asked for, echoed (its format is enforced)."""
        text = self.body.text if isinstance(self.body.text, dict) else {}
        return {**text, "format": text.get("format") or {"type": "text"}}

    def output_text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.output if i["type"] == "message")

    def _ev(self, name: str, payload: dict[str, Any]) -> Event:
        """An event; the items and responses in it are copies (the live ones change later)."""
        self._seq += 1
        snap = {k: copy.deepcopy(v) if k in ("item", "response", "part") else v for k, v in payload.items()}
        return name, {"type": name, "sequence_number": self._seq, **snap}

    def start(self) -> list[Event]:
        return [
            self._ev("response.created", {"response": self.envelope("in_progress")}),
            self._ev("response.in_progress", {"response": self.envelope("in_progress")}),
        ]

    def _close(self) -> list[Event]:
        current, out = self._current, []
        if current is None:
            return out
        idx = self.output.index(current)
        if current["type"] == "message":
            part = current["content"][0]
            out.append(self._ev("response.output_text.done", {"item_id": current["id"], "output_index": idx,
                                                               "content_index": 0, "text": part["text"], "logprobs": []}))
            out.append(self._ev("response.content_part.done", {"item_id": current["id"], "output_index": idx,
                                                                "content_index": 0, "part": part}))
        elif current["type"] == "reasoning":
            part = current["content"][0]
            out.append(self._ev("response.reasoning_text.done", {"item_id": current["id"], "output_index": idx,
                                                                  "content_index": 0, "text": part["text"]}))
        current["status"] = "completed"
        out.append(self._ev("response.output_item.done", {"output_index": idx, "item": current}))
        self._current = None
        return out

    def _reasoning(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self._current is None or self._current["type"] != "reasoning":
            out += self._close()
            self._current = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                             "content": [{"type": "reasoning_text", "text": ""}]}
            self.output.append(self._current)
            out.append(self._ev("response.output_item.added", {"output_index": len(self.output) - 1,
                                                                "item": self._current}))
        self._current["content"][0]["text"] += text
        out.append(self._ev("response.reasoning_text.delta", {
            "item_id": self._current["id"], "output_index": self.output.index(self._current),
            "content_index": 0, "delta": text,
        }))  # fmt: skip
        return out

    def _text(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self._current is None or self._current["type"] != "message":
            out += self._close()
            self._current = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                             "content": [{"type": "output_text", "text": "", "annotations": []}]}
            self.output.append(self._current)
            idx = len(self.output) - 1
            out.append(self._ev("response.output_item.added", {"output_index": idx, "item": {**self._current, "content": []}}))
            out.append(self._ev("response.content_part.added", {
                "item_id": self._current["id"], "output_index": idx, "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []},
            }))  # fmt: skip
        self._current["content"][0]["text"] += text
        out.append(self._ev("response.output_text.delta", {
            "item_id": self._current["id"], "output_index": self.output.index(self._current),
            "content_index": 0, "delta": text, "logprobs": [],
        }))  # fmt: skip
        return out

    def _call(self, d: ToolCall) -> list[Event]:
        out = self._close()
        self.calls.append(d)
        call = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": d.id,
                "name": d.name, "arguments": ""}
        self.output.append(call)
        idx = len(self.output) - 1
        out.append(self._ev("response.output_item.added", {"output_index": idx, "item": dict(call)}))
        out.append(self._ev("response.function_call_arguments.delta", {"item_id": call["id"], "output_index": idx,
                                                                         "delta": d.arguments}))
        call["arguments"] = d.arguments
        out.append(self._ev("response.function_call_arguments.done", {"item_id": call["id"], "output_index": idx,
                                                                        "arguments": d.arguments}))
        call["status"] = "completed"
        out.append(self._ev("response.output_item.done", {"output_index": idx, "item": call}))
        return out

    def feed(self, deltas: list[Delta]) -> list[Event]:
        out: list[Event] = []
        for d in deltas:
            if isinstance(d, ReasoningDelta):
                out += self._reasoning(d.text)
            elif isinstance(d, TextDelta):
                if d.text:
                    out += self._text(d.text)
            elif isinstance(d, ToolCall):
                out += self._call(d)
        return out

    def finish(self, final: ChatFinal) -> list[Event]:
        """Closes the open item; the completed (or incomplete) response, with `warnings` when
        there are any, becomes `final_response`."""
        out = self._close()
        status = "incomplete" if final.finish_reason == "length" else "completed"
        response = self.envelope(status, response_usage(final))
        if status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if final.warnings:
            response["warnings"] = [w.as_json() for w in final.warnings]
        self.final_response = response
        out.append(self._ev(f"response.{status}", {"response": response}))
        return out
