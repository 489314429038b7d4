"""The API-neutral chat turn: render with tools and thinking, generate, parse the output.

OpenAI chat, Anthropic Messages and the Responses API each convert their wire
request into a `ChatTurn` (HF-style messages, tool specs, sampling values) and
consume the same stream of parsed deltas (`TextDelta`, `ReasoningDelta`,
`ToolCall`) ending in a `ChatFinal`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from omlx.api.chat_template import TURN_MARK, encode_spliced, render_text
from omlx.api.images import ImageLimits, ImageRef
from omlx.api.output_format import OutputFormat
from omlx.api.output_parser import OutputParser
from omlx.api.tool_call_formats import detect_family, prompt_opens_reasoning
from omlx.api.tool_calls import OutputWarning, ReasoningDelta, TextDelta, ToolCall
from omlx.api.tool_prompt import inject_tools_into_system, template_supports_tools
from omlx.engine.llm_engine import LLMEngine
from omlx.engine.request import GenerationEvent, GenerationRequest, new_request_id
from omlx.engine.vision_input import OcrInput, VisionInput
from omlx.errors import InvalidRequestError
from omlx.pool.engine_pool import Resolved
from omlx.server.generation import completion_budget, event_error, sampling_params
from omlx.server.log_setup import bind
from omlx.server.ocr_prompt import ocr_prompt
from omlx.server.structured import build_constraint, tool_forcing
from omlx.server.turn_memory import GeneratedTurn, TurnMemory, answer_prefill
from omlx.server.vision_prompt import check_sampling, expand, load_images, with_image_parts

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
    warnings: list[OutputWarning] = field(default_factory=list)  # found in the request (images …)
    images: list[ImageRef] = field(default_factory=list)  # a vision model's, in the order of their marks
    image_limits: ImageLimits = field(default_factory=ImageLimits)


@dataclass
class PreparedChat:
    request: GenerationRequest
    family: str | None
    tools: list[dict[str, Any]] | None
    reasoning: bool
    starts_in_reasoning: bool
    think_start: str = "<think>"
    think_end: str = "</think>"
    warnings: list[OutputWarning] = field(default_factory=list)  # the request's own
    memory: TurnMemory | None = None  # where the answer is remembered as generated
    model_id: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)  # as the client sent them
    formatted: bool = False  # an output format was asked for: the answer is that, not a call

    def remember(self, text: str, tokens: list[int], content: str, calls: list[ToolCall], ev: GenerationEvent) -> None:
        """Keep an answer that ended normally, as generated, for the conversation's next request."""
        if self.memory is not None and ev.finish_reason in ("stop", "length") and ev.stop_string is None:
            self.memory.remember(self.model_id, self.messages, text, tokens, content, calls)

    def new_parser(self) -> OutputParser:
        return OutputParser(
            family=self.family,
            tools=self.tools,
            reasoning=self.reasoning,
            think_start=self.think_start,
            think_end=self.think_end,
            starts_in_reasoning=self.starts_in_reasoning,
            unknown_tool_calls=not self.formatted,
        )


@dataclass
class ChatFinal:
    finish_reason: str  # "stop" | "length" | "tool_calls"
    stop_string: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    warnings: list[OutputWarning] = field(default_factory=list)  # the request's, then the output's
    cache: dict[str, Any] | None = None  # the prompt's restore by tier and why (usage's `omlx`)


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


def render_turn(
    tokenizer: Any,
    turn: ChatTurn,
    tools: list[dict[str, Any]] | None,
    native_tools: bool,
    recalled: dict[int, GeneratedTurn] | None = None,
    prefill: str = "",
) -> tuple[list[int], list[int]]:
    """The prompt's token ids; assistant turns in `recalled` (by message index) are rendered as
    generated (`prefill` + their text) and keep their token ids. Also returns the indices (into
    the recalled turns, in order) that the template rewrote, encoded as text instead."""
    messages = [dict(m) for m in turn.messages]
    for k, (index, generated) in enumerate(sorted((recalled or {}).items())):
        messages[index] = {"role": "assistant", "content": prefill + TURN_MARK.format(k) + generated.text}
    # A forced tool choice is held by its grammar, not asked for in the prompt: a prompt that
    # changed with the tool choice would lose the conversation's cached prefix.
    if tools and not native_tools:
        messages = inject_tools_into_system(messages, tools)
    template_tools = [{"type": "function", "function": t} for t in tools] if tools and native_tools else None
    try:
        text = render_text(tokenizer, messages, tools=template_tools, template_kwargs=turn.template_kwargs)
    except InvalidRequestError:
        if recalled:  # a template that wants the calls as the client sent them
            return render_turn(tokenizer, turn, tools, native_tools)
        late_system = any(m["role"] == "system" for m in messages[1:])
        if not late_system:
            raise
        text = render_text(
            tokenizer, _fold_late_system(messages), tools=template_tools, template_kwargs=turn.template_kwargs
        )
    turns = [(g.text, list(g.tokens)) for _, g in sorted((recalled or {}).items())]
    return encode_spliced(tokenizer, text, turns)


def recall_turns(memory: TurnMemory | None, model: str, messages: list[dict[str, Any]]) -> dict[int, GeneratedTurn]:
    """The assistant turns of `messages` this server generated and the client sent back unchanged."""
    if memory is None:
        return {}
    found = {}
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            generated = memory.recall(model, messages, i)
            if generated is not None:
                found[i] = generated
    return found


def _prefill(engine: LLMEngine, template_kwargs: dict[str, Any]) -> str:
    """`answer_prefill` of the engine's template, probed once per set of template arguments."""
    cache = engine.__dict__.setdefault("answer_prefills", {})
    key = repr(sorted(template_kwargs.items()))
    if key not in cache:
        cache[key] = answer_prefill(engine.tokenizer, template_kwargs)
    return cache[key]


@dataclass
class RenderedPrompt:
    tokens: list[int]
    recalled: int  # earlier assistant turns found in the turn memory, rendered as generated
    rewritten: int  # how many of them the chat template rewrote
    vision: VisionInput | OcrInput | None = None  # the images' pixels and where their tokens lie
    tools: list[dict[str, Any]] | None = None  # the tools offered (none under tool_choice "none")
    native: bool = False  # rendered by the template itself (else described in the system prompt)


async def render_prompt(
    engine: LLMEngine, resolved: Resolved, turn: ChatTurn, memory: TurnMemory | None = None
) -> RenderedPrompt:
    """The prompt tokens `turn` renders to with the model's chat template, its tools and the model's
    template defaults (a thread: templates of long histories are slow), earlier assistant turns
    this server generated rendered as generated (`memory`), images expanded to their keyed tokens.
    `prepare_chat` and `POST /api/cache/explain` both render through here."""
    tools = None if turn.tool_choice == "none" else (turn.tools or None)
    native = bool(tools) and template_supports_tools(engine.tokenizer)
    turn.template_kwargs = {**(resolved.defaults.chat_template_kwargs or {}), **turn.template_kwargs}
    preset = resolved.defaults.system_prompt
    if preset and not any(m.get("role") == "system" for m in turn.messages):
        turn.messages = [{"role": "system", "content": preset}, *turn.messages]
    recalled = recall_turns(memory, engine.model_id, turn.messages)
    prefill = _prefill(engine, turn.template_kwargs) if recalled else ""
    parts = getattr(engine.loaded, "vision", None)
    if parts is not None and parts.ocr is not None:  # DeepSeek-OCR: its processor lays out the prompt
        if tools:
            raise InvalidRequestError(f"model '{engine.model_id}' is an OCR model; its prompt format has no tools.", param="tools")
        tokens, ocr = await ocr_prompt(engine, parts, turn.messages, turn.images, turn.image_limits)
        return RenderedPrompt(tokens, 0, 0, ocr)
    if turn.images:
        if parts is None:
            raise InvalidRequestError(f"model '{engine.model_id}' cannot read images.", param="messages")
        pixel_values, grid, digests = await load_images(turn.images, turn.image_limits, parts)
        shown = replace(turn, messages=with_image_parts(turn.messages))
    else:
        shown = turn
    prompt, rewritten = await asyncio.to_thread(render_turn, engine.tokenizer, shown, tools, native, recalled, prefill)
    vision = None
    if turn.images:
        prompt, spans = expand(prompt, parts, grid, digests)
        keys = {start: digest for (start, _), digest in zip(spans, digests, strict=True)}
        vision = VisionInput(pixel_values, grid, spans, parts.activation_bytes(grid), keys)
    return RenderedPrompt(prompt, len(recalled), len(rewritten), vision, tools, native)


async def prepare_chat(
    engine: LLMEngine, resolved: Resolved, turn: ChatTurn, default_max_tokens: int, memory: TurnMemory | None = None
) -> PreparedChat:
    """Render, budget and constrain the turn; earlier assistant turns this server generated go
    back into the prompt as generated (`memory`), and so does this one's answer."""
    tokenizer = engine.tokenizer
    defaults = resolved.defaults
    request_id = new_request_id(turn.id_prefix)
    rendered = await render_prompt(engine, resolved, turn, memory)
    tools = rendered.tools
    family = _family(engine) if rendered.native or not tools else "hermes"
    prompt, rewritten, recalled, vision = rendered.tokens, rendered.rewritten, rendered.recalled, rendered.vision
    if rewritten:
        log.info(
            "request=%s: the chat template rewrote %d of the %d earlier assistant turns sent back as generated "
            "(e.g. it drops past reasoning); the prompt differs from the previous one from the first of them on, "
            "and the cache restores only what precedes it", request_id, rewritten, recalled,
        )  # fmt: skip
    think_start = getattr(tokenizer, "think_start", None) or "<think>"
    think_end = getattr(tokenizer, "think_end", None) or "</think>"
    reasoning = bool(getattr(tokenizer, "has_thinking", False))
    starts_in_reasoning = reasoning and prompt_opens_reasoning(tokenizer.decode(prompt[-32:]), think_start, think_end)
    if turn.max_tokens == 0:
        raise InvalidRequestError("max_tokens must be at least 1.", param="max_tokens")
    budget = completion_budget(
        engine, len(prompt), turn.max_tokens, defaults.max_tokens or default_max_tokens,
        window_cap=defaults.context_length, cap=defaults.max_tokens_cap,
    )
    sampling = sampling_params(
        turn.sampling, defaults, seed=turn.seed, logit_bias=turn.logit_bias, vocab_size=engine.model_vocab_size
    )
    if vision is not None:
        check_sampling(sampling)
    constraint, family = await build_constraint(
        engine, fmt=turn.output_format, forcing=tool_forcing(tools, turn.tool_choice, turn.output_format is not None),
        family=family, starts_in_reasoning=starts_in_reasoning, budget=turn.thinking_budget,
    )  # fmt: skip
    request = GenerationRequest(
        request_id=request_id,
        prompt_tokens=prompt,
        max_tokens=budget,
        sampling=sampling,
        stop=turn.stop,
        logprobs=turn.logprobs,
        constraint=constraint,
        vision=vision,
        rewritten_turns=rewritten,
    )
    bind(request_id=request.request_id)
    return PreparedChat(
        request, family, tools, reasoning, starts_in_reasoning, think_start, think_end, list(turn.warnings),
        memory, engine.model_id, turn.messages, turn.output_format is not None,
    )


def final_from(ev: GenerationEvent, parser: OutputParser, prepared: PreparedChat | None = None) -> ChatFinal:
    """The finish of a parsed generation: any tool call makes it `tool_calls` (also when the
    length limit cut text after the calls), and the warnings of the request and the output."""
    reason = ev.finish_reason or "stop"
    if parser.tool_calls and reason in ("stop", "length"):
        reason = "tool_calls"
    warnings = [*(prepared.warnings if prepared else []), *parser.warnings]
    return ChatFinal(
        reason, ev.stop_string, ev.prompt_tokens, ev.cached_tokens, ev.completion_tokens, warnings, ev.cache
    )


async def parsed_events(
    events: AsyncIterator[GenerationEvent], parser: OutputParser, prepared: PreparedChat | None = None
) -> AsyncIterator[tuple[list[TextDelta | ReasoningDelta | ToolCall], GenerationEvent]]:
    """Each engine event with the parsed deltas its text produced (the last one also flushes);
    at the end the answer is remembered as generated (`PreparedChat.remember`)."""
    text: list[str] = []
    tokens: list[int] = []
    content: list[str] = []
    async for ev in events:
        if ev.finish_reason == "error":
            raise event_error(ev)
        deltas = parser.feed(ev.text) if ev.text else []
        if ev.finish_reason is not None:
            deltas += parser.finish()
        text.append(ev.text)
        if prepared is not None:
            tokens += ev.token_ids
            content += [d.text for d in deltas if isinstance(d, TextDelta)]
            if ev.finish_reason is not None:
                prepared.remember("".join(text), tokens, "".join(content), parser.tool_calls, ev)
        if ev.finish_reason is not None and log.isEnabledFor(logging.DEBUG):
            request_id = prepared.request.request_id if prepared else "-"
            log.debug("request=%s raw_output=%s tool_calls=%d warnings=%s", request_id, json.dumps("".join(text)),
                      len(parser.tool_calls), ",".join(w.code for w in parser.warnings) or "-")  # fmt: skip
        yield deltas, ev


@dataclass
class ChatResult:
    deltas: list[TextDelta | ReasoningDelta | ToolCall]
    final: ChatFinal
    events: list[GenerationEvent]


async def run_chat(engine: LLMEngine, prepared: PreparedChat, request: GenerationRequest | None = None) -> ChatResult:
    """One sequence run to its end: every parsed delta, the finish, the engine's events."""
    parser = prepared.new_parser()
    deltas: list[TextDelta | ReasoningDelta | ToolCall] = []
    events: list[GenerationEvent] = []
    final = None
    async for batch, ev in parsed_events(engine.generate(request or prepared.request), parser, prepared):
        events.append(ev)
        deltas += batch
        if ev.finish_reason is not None:
            final = final_from(ev, parser, prepared)
    assert final is not None
    return ChatResult(deltas, final, events)
