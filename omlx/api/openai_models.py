"""OpenAI wire models (requests) for chat completions and completions.

Unknown fields are accepted and ignored (`wire.Lenient`); ranges are validated here
(`omlx/api/wire.py`) so a bad value is a 400 that names the parameter.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictBool

from omlx.api.wire import Lenient, LogitBias, SamplingValues, Seed, StopField


class StreamOptions(Lenient):
    include_usage: bool = False


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class SamplingFields(SamplingValues):
    model: str
    max_tokens: int | None = Field(default=None, ge=0)
    seed: Seed = None
    stop: StopField = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: LogitBias = None
    user: str | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # reasoning tokens before the model's end-of-thinking marker is forced (oMLX's own field)
    thinking_budget: int | None = Field(default=None, ge=0)
    reasoning_effort: str | None = None
    # the server runs the MCP tools the model calls (oMLX's own field: omlx/server/mcp_loop.py)
    mcp: StrictBool | dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    # the output is held to one of these (oMLX's own fields)
    json_schema: dict[str, Any] | bool | None = None
    regex: str | None = None
    grammar: str | None = None  # Lark, as llguidance reads it
