"""OpenAI chat completions output: parsed deltas → `chat.completion.chunk` events per choice,
and each choice's message for the non-streaming body (the streamed choice, accumulated)."""

from __future__ import annotations

from typing import Any

from omlx.api.tool_calls import Delta, ReasoningDelta, TextDelta, ToolCall
from omlx.server.chat_pipeline import ChatFinal
from omlx.server.generation import usage_dict
from omlx.server.sse import sse_data


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    """`arguments` as the parser gave them: a JSON object's text, or the arguments as generated."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_usage(finals: list[ChatFinal]) -> dict[str, Any]:
    return usage_dict(finals[0].prompt_tokens, sum(f.completion_tokens for f in finals), finals[0].cached_tokens, finals[0].cache)


class ChoiceState:
    """What one choice has said so far (its message once it is finished)."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []

    def message(self) -> dict[str, Any]:
        text = "".join(self.text)
        msg: dict[str, Any] = {"role": "assistant", "content": text if (text or not self.calls) else None}
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        if self.calls:
            msg["tool_calls"] = [tool_call_json(c) for c in self.calls]
        return msg


class ChatChunks:
    """The chunk stream of one chat completion with `n` choices: `start()`, `feed(i, …)` per
    batch of a choice's deltas, `finish(i, final)`, `end(finals)`. Pure: no engine, no I/O."""

    def __init__(self, rid: str, model: str, created: int, n: int = 1, include_usage: bool = False):
        self.rid, self.model, self.created, self.include_usage = rid, model, created, include_usage
        self.choices = [ChoiceState() for _ in range(n)]

    def chunk(self, choices: list[dict[str, Any]], usage: Any = None) -> str:
        payload: dict[str, Any] = {"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                                   "model": self.model, "system_fingerprint": None, "choices": choices}
        if self.include_usage:
            payload["usage"] = usage
        return sse_data(payload)

    def start(self) -> list[str]:
        return [
            self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
            for i in range(len(self.choices))
        ]

    def feed(self, i: int, deltas: list[Delta], logprobs: Any = None) -> list[str]:
        """The choice's chunks; `logprobs` (of the tokens behind these deltas) ride on the first."""
        state, out = self.choices[i], []
        for d in deltas:
            if isinstance(d, TextDelta) and d.text:
                state.text.append(d.text)
                delta: dict[str, Any] = {"content": d.text}
            elif isinstance(d, ReasoningDelta) and d.text:
                state.reasoning.append(d.text)
                delta = {"reasoning_content": d.text}
            elif isinstance(d, ToolCall):
                delta = {"tool_calls": [{"index": len(state.calls), **tool_call_json(d)}]}
                state.calls.append(d)
            else:
                continue
            out.append(self.chunk([{"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": None}]))
            logprobs = None
        if logprobs is not None:
            out.append(self.chunk([{"index": i, "delta": {}, "logprobs": logprobs, "finish_reason": None}]))
        return out

    def finish(self, i: int, final: ChatFinal) -> list[str]:
        """The choice's last chunk: its finish reason and, when there are any, its `warnings`."""
        choice: dict[str, Any] = {"index": i, "delta": {}, "logprobs": None, "finish_reason": final.finish_reason}
        if final.warnings:
            choice["warnings"] = [w.as_json() for w in final.warnings]
        return [self.chunk([choice])]

    def end(self, finals: list[ChatFinal | None]) -> list[str]:
        out = []
        if self.include_usage and all(finals):
            out.append(self.chunk([], chat_usage(finals)))  # type: ignore[arg-type]
        out.append("data: [DONE]\n\n")
        return out

    def choice_body(self, i: int, final: ChatFinal, logprobs: Any = None) -> dict[str, Any]:
        """Choice `i` of the non-streaming body."""
        choice: dict[str, Any] = {"index": i, "message": self.choices[i].message(), "logprobs": logprobs,
                                  "finish_reason": final.finish_reason}
        if final.warnings:
            choice["warnings"] = [w.as_json() for w in final.warnings]
        return choice
