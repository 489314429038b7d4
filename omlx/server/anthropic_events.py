"""Anthropic Messages output: parsed deltas → the streaming event sequence, and the same
message as one JSON body (a non-streaming answer is the streamed one, accumulated)."""

from __future__ import annotations

import json
from typing import Any

from omlx.api.tool_calls import Delta, ReasoningDelta, TextDelta, ToolCall
from omlx.server.chat_pipeline import ChatFinal
from omlx.server.generation import omlx_usage
from omlx.server.sse import sse_event


def stop_reason(final: ChatFinal) -> tuple[str, str | None]:
    if final.finish_reason == "tool_calls":
        return "tool_use", None
    if final.finish_reason == "length":
        return "max_tokens", None
    if final.stop_string is not None:
        return "stop_sequence", final.stop_string
    return "end_turn", None


def usage(final: ChatFinal) -> dict[str, Any]:
    return {
        "input_tokens": final.prompt_tokens - final.cached_tokens,
        "output_tokens": final.completion_tokens,
        "cache_read_input_tokens": final.cached_tokens,
        "cache_creation_input_tokens": 0,
        **omlx_usage(final.cache),
    }


def tool_use_id(call: ToolCall) -> str:
    """`toolu_` + the call's own id (the same hex every API uses for this call)."""
    return "toolu_" + call.id.removeprefix("call_")


def tool_input(call: ToolCall) -> dict[str, Any]:
    """A tool_use block's `input` (an object by the protocol): arguments that are not a JSON
    object travel as generated under `_raw`, for the client's validation to report."""
    if call.problem:
        return {"_raw": call.arguments}
    value = json.loads(call.arguments)
    return value if isinstance(value, dict) else {"_raw": call.arguments}


class MessageEvents:
    """One message's events in order: `start()`, `feed()` per batch of deltas, `finish()`; the
    blocks it streamed are kept for `message()`. Pure: no engine, no I/O."""

    def __init__(self, msg_id: str, model: str, prompt_tokens: int):
        self.msg_id, self.model, self.prompt_tokens = msg_id, model, prompt_tokens
        self.content: list[dict[str, Any]] = []
        self._open: str | None = None  # kind of the open block

    def start(self) -> list[str]:
        """message_start, then a ping right away (prefill may take minutes)."""
        return [
            sse_event("message_start", {
                "type": "message_start",
                "message": {
                    "id": self.msg_id, "type": "message", "role": "assistant", "model": self.model,
                    "content": [], "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": self.prompt_tokens, "output_tokens": 0,
                              "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0},
                },
            }),
            sse_event("ping", {"type": "ping"}),
        ]  # fmt: skip

    def _close(self) -> list[str]:
        out = []
        index = len(self.content) - 1
        if self._open == "thinking":
            out.append(sse_event("content_block_delta", {
                "type": "content_block_delta", "index": index,
                "delta": {"type": "signature_delta", "signature": ""},
            }))  # fmt: skip
        if self._open is not None:
            out.append(sse_event("content_block_stop", {"type": "content_block_stop", "index": index}))
        self._open = None
        return out

    def _begin(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self._close()
        self.content.append(block)
        self._open = kind
        shown = {**block, "input": {}} if kind == "tool_use" else dict(block)
        out.append(sse_event("content_block_start", {
            "type": "content_block_start", "index": len(self.content) - 1, "content_block": shown,
        }))  # fmt: skip
        return out

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse_event("content_block_delta", {
            "type": "content_block_delta", "index": len(self.content) - 1, "delta": delta,
        })  # fmt: skip

    def feed(self, deltas: list[Delta]) -> list[str]:
        out: list[str] = []
        for d in deltas:
            if isinstance(d, ReasoningDelta):
                if self._open != "thinking":
                    out += self._begin("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                self.content[-1]["thinking"] += d.text
                out.append(self._delta({"type": "thinking_delta", "thinking": d.text}))
            elif isinstance(d, TextDelta):
                if not d.text:
                    continue
                if self._open != "text":
                    out += self._begin("text", {"type": "text", "text": ""})
                self.content[-1]["text"] += d.text
                out.append(self._delta({"type": "text_delta", "text": d.text}))
            elif isinstance(d, ToolCall):
                block = {"type": "tool_use", "id": tool_use_id(d), "name": d.name, "input": tool_input(d)}
                out += self._begin("tool_use", block)
                partial = json.dumps(block["input"], ensure_ascii=False) if d.problem else d.arguments
                out.append(self._delta({"type": "input_json_delta", "partial_json": partial}))
        return out

    def finish(self, final: ChatFinal) -> list[str]:
        """Closes the open block (an empty text block when nothing was said), then
        message_delta (stop reason, usage, `warnings` when there are any) and message_stop."""
        out = [] if self.content else self._begin("text", {"type": "text", "text": ""})
        out += self._close()
        reason, sequence = stop_reason(final)
        delta: dict[str, Any] = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                 "usage": usage(final)}
        if final.warnings:
            delta["warnings"] = [w.as_json() for w in final.warnings]
        out.append(sse_event("message_delta", delta))
        out.append(sse_event("message_stop", {"type": "message_stop"}))
        return out

    def message(self, final: ChatFinal) -> dict[str, Any]:
        """The non-streaming body: what `start`/`feed`/`finish` streamed, as one message."""
        reason, sequence = stop_reason(final)
        body: dict[str, Any] = {
            "id": self.msg_id, "type": "message", "role": "assistant", "model": self.model,
            "content": self.content or [{"type": "text", "text": ""}], "stop_reason": reason,
            "stop_sequence": sequence, "usage": usage(final),
        }  # fmt: skip
        if final.warnings:
            body["warnings"] = [w.as_json() for w in final.warnings]
        return body
