"""The API-neutral chat turn: render with tools and thinking, generate, parse the output.

OpenAI chat, Anthropic Messages and the Responses API each convert their wire
request into a `ChatTurn` (HF-style messages, tool specs, sampling values) and
consume the same stream of parsed deltas (`TextDelta`, `ReasoningDelta`,
`ToolCall`) ending in a `ChatFinal`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from omlx.api.chat_template import render_chat
from omlx.api.output_format import OutputFormat
from omlx.api.output_parser import OutputParser
from omlx.api.tool_call_formats import detect_family, prompt_opens_reasoning
from omlx.api.tool_calls import ReasoningDelta, TextDelta, ToolCall
from omlx.api.tool_prompt import inject_tools_into_system, template_supports_tools
from omlx.engine.llm_engine import LLMEngine
from omlx.engine.request import GenerationEvent, GenerationRequest, new_request_id
from omlx.errors import InvalidRequestError
from omlx.pool.engine_pool import Resolved
from omlx.server.generation import completion_budget, event_error, sampling_params
from omlx.server.log_setup import bind
from omlx.server.structured import build_constraint, tool_forcing

log = logging.getLogger("omlx.server")



@dataclass
class ChatTurn:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None  # [{"name", "description", "parameters"}]
    tool_choice: str | None = None  # "auto" | "none" | "required" | a tool name
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)  # request values; None = not given
    seed: int | None = None
    logit_bias: dict[str, float] | None = None  # as the wire has it: token ids as strings
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    logprobs: int | None = None
    id_prefix: str = "chatcmpl"
    output_format: OutputFormat | None = None  # held to it (docs/design/structured-output.md)
    thinking_budget: int | None = None  # reasoning tokens before the end of thinking is forced


@dataclass
class PreparedChat:
    request: GenerationRequest
    family: str | None
    tools: list[dict[str, Any]] | None
    reasoning: bool
    starts_in_reasoning: bool
    think_start: str = "<think>"
    think_end: str = "</think>"

    def new_parser(self) -> OutputParser:
        return OutputParser(
            family=self.family,
            tools=self.tools,
            reasoning=self.reasoning,
            think_start=self.think_start,
            think_end=self.think_end,
            starts_in_reasoning=self.starts_in_reasoning,
        )


@dataclass
class ChatFinal:
    finish_reason: str  # "stop" | "length" | "tool_calls"
    stop_string: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cache: dict[str, Any] | None = None  # the prompt's restore by tier and why (usage's `omlx`)


def _tool_instruction(choice: str | None, tools: list[dict[str, Any]]) -> str | None:
    if choice in (None, "auto", "none"):
        return None
    if choice in ("required", "any"):
        return "You must answer by calling one of the available tools."
    return f"You must answer by calling the tool '{choice}'."


def _fold_late_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Templates that allow a system message only first: fold later ones into the first."""
    systems = [m for m in messages if m["role"] == "system"]
    rest = [m for m in messages if m["role"] != "system"]
    if not systems:
        return messages
    merged = "\n\n".join(str(m.get("content") or "") for m in systems)
    return [{"role": "system", "content": merged}, *rest]


def _family(engine: LLMEngine) -> str | None:
    """The model's tool-call family, detected once per engine (it scans the vocabulary)."""
    if not hasattr(engine, "tool_family"):
        engine.tool_family = detect_family(engine.tokenizer)  # type: ignore[attr-defined]
    return engine.tool_family  # type: ignore[attr-defined]


def render_turn(tokenizer: Any, turn: ChatTurn, tools: list[dict[str, Any]] | None, native_tools: bool) -> list[int]:
    messages = [dict(m) for m in turn.messages]
    instruction = _tool_instruction(turn.tool_choice, tools or [])
    if tools and not native_tools:
        messages = inject_tools_into_system(messages, tools)
    if instruction:
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": f"{messages[0].get('content') or ''}\n\n{instruction}"}
        else:
            messages.insert(0, {"role": "system", "content": instruction})
    template_tools = [{"type": "function", "function": t} for t in tools] if tools and native_tools else None
    try:
        return render_chat(tokenizer, messages, tools=template_tools, template_kwargs=turn.template_kwargs)
    except InvalidRequestError:
        late_system = any(m["role"] == "system" for m in messages[1:])
        if not late_system:
            raise
        return render_chat(
            tokenizer, _fold_late_system(messages), tools=template_tools, template_kwargs=turn.template_kwargs
        )


async def render_prompt(engine: LLMEngine, resolved: Resolved, turn: ChatTurn) -> list[int]:
    """The prompt tokens `turn` renders to with the model's chat template, its tools and the model's
    template defaults (a thread: templates of long histories are slow); `prepare_chat` and
    `POST /api/cache/explain` both render through here."""
    tools = None if turn.tool_choice == "none" else (turn.tools or None)
    native = bool(tools) and template_supports_tools(engine.tokenizer)
    turn.template_kwargs = {**(resolved.defaults.chat_template_kwargs or {}), **turn.template_kwargs}
    return await asyncio.to_thread(render_turn, engine.tokenizer, turn, tools, native)


async def prepare_chat(
    engine: LLMEngine, resolved: Resolved, turn: ChatTurn, default_max_tokens: int
) -> PreparedChat:
    tokenizer = engine.tokenizer
    defaults = resolved.defaults
    tools = None if turn.tool_choice == "none" else (turn.tools or None)
    native = bool(tools) and template_supports_tools(tokenizer)
    family = _family(engine) if native or not tools else "hermes"
    prompt = await render_prompt(engine, resolved, turn)
    think_start = getattr(tokenizer, "think_start", None) or "<think>"
    think_end = getattr(tokenizer, "think_end", None) or "</think>"
    reasoning = bool(getattr(tokenizer, "has_thinking", False))
    starts_in_reasoning = reasoning and prompt_opens_reasoning(tokenizer.decode(prompt[-32:]), think_start, think_end)
    if turn.max_tokens == 0:
        raise InvalidRequestError("max_tokens must be at least 1.", param="max_tokens")
    budget = completion_budget(
        engine, len(prompt), turn.max_tokens, defaults.max_tokens or default_max_tokens,
        window_cap=defaults.context_length,
    )
    sampling = sampling_params(
        turn.sampling, defaults, seed=turn.seed, logit_bias=turn.logit_bias, vocab_size=engine.model_vocab_size
    )
    constraint, family = await build_constraint(
        engine, fmt=turn.output_format, forcing=tool_forcing(tools, turn.tool_choice, turn.output_format is not None),
        family=family, starts_in_reasoning=starts_in_reasoning, budget=turn.thinking_budget,
    )  # fmt: skip
    request = GenerationRequest(
        request_id=new_request_id(turn.id_prefix),
        prompt_tokens=prompt,
        max_tokens=budget,
        sampling=sampling,
        stop=turn.stop,
        logprobs=turn.logprobs,
        constraint=constraint,
    )
    bind(request_id=request.request_id)
    return PreparedChat(request, family, tools, reasoning, starts_in_reasoning, think_start, think_end)


def final_from(ev: GenerationEvent, parser: OutputParser) -> ChatFinal:
    reason = ev.finish_reason or "stop"
    if parser.tool_calls and reason == "stop":
        reason = "tool_calls"
    return ChatFinal(reason, ev.stop_string, ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens, ev.cache)


async def parsed_events(
    events: AsyncIterator[GenerationEvent], parser: OutputParser
) -> AsyncIterator[tuple[list[TextDelta | ReasoningDelta | ToolCall], GenerationEvent]]:
    """Each engine event with the parsed deltas its text produced (the last one also flushes)."""
    async for ev in events:
        if ev.finish_reason == "error":
            raise event_error(ev)
        deltas = parser.feed(ev.text) if ev.text else []
        if ev.finish_reason is not None:
            deltas += parser.finish()
        yield deltas, ev


@dataclass
class ChatResult:
    text: str
    reasoning: str
    tool_calls: list[ToolCall]
    final: ChatFinal
    events: list[GenerationEvent]


async def run_chat(engine: LLMEngine, prepared: PreparedChat, request: GenerationRequest | None = None) -> ChatResult:
    parser = prepared.new_parser()
    text, reasoning, calls, events = [], [], [], []
    final = None
    async for deltas, ev in parsed_events(engine.generate(request or prepared.request), parser):
        events.append(ev)
        for d in deltas:
            if isinstance(d, TextDelta):
                text.append(d.text)
            elif isinstance(d, ReasoningDelta):
                reasoning.append(d.text)
            else:
                calls.append(d)
        if ev.finish_reason is not None:
            final = final_from(ev, parser)
    assert final is not None
    return ChatResult("".join(text), "".join(reasoning), calls, final, events)
