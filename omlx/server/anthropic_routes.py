"""Anthropic Messages API: /v1/messages (streaming and not) and /v1/messages/count_tokens."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from omlx.api.anthropic_models import (
    CountTokensRequest,
    MessagesRequest,
    thinking_budget,
    thinking_kwargs,
    to_chat_messages,
    tool_choice_name,
    tool_input,
    tool_specs,
)
from omlx.api.output_format import anthropic_output_format
from omlx.api.tool_calls import ReasoningDelta, TextDelta, ToolCall
from omlx.api.tool_prompt import template_supports_tools
from omlx.engine.llm_engine import LLMEngine
from omlx.pool.engine_pool import Resolved
from omlx.server.chat_pipeline import (
    ChatFinal,
    ChatTurn,
    final_from,
    parsed_events,
    prepare_chat,
    render_turn,
    run_chat,
)
from omlx.server.generation import omlx_usage
from omlx.server.openai_routes import default_max_tokens, with_llm
from omlx.server.sse import KEEPALIVE, EventStream, sse_event, with_keepalive

router = APIRouter()


def _turn(body: MessagesRequest) -> ChatTurn:
    tools = tool_specs(body.tools)
    return ChatTurn(
        messages=to_chat_messages(body),
        tools=tools,
        tool_choice=tool_choice_name(body.tool_choice, tools),
        max_tokens=body.max_tokens,
        stop=list(body.stop_sequences or []),
        sampling={"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k},
        template_kwargs=thinking_kwargs(body.thinking),
        id_prefix="msg",
        output_format=anthropic_output_format(body.output_config, body.output_format),
        thinking_budget=thinking_budget(body.thinking),
    )


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


def _tool_id() -> str:
    return "toolu_" + secrets.token_hex(12)


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    turn = _turn(body)  # checked before the model is leased (or loaded)
    return await with_llm(request, body.model, lambda e, r: _messages(body, turn, request, e, r))


async def _messages(body: MessagesRequest, turn: ChatTurn, request: Request, engine: LLMEngine, resolved: Resolved):
    prepared = await prepare_chat(engine, resolved, turn, default_max_tokens(request, resolved.defaults))
    msg_id = prepared.request.request_id
    requests = [prepared.request]
    engine.reserve(requests)
    if body.stream:
        return EventStream(
            _stream(engine, prepared, msg_id, body.model, request.app.state.settings.keepalive_interval),
            on_close=lambda: engine.release(requests),
        )
    try:
        result = await run_chat(engine, prepared)
    finally:
        engine.release(requests)
    content: list[dict[str, Any]] = []
    if result.reasoning:
        content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
    if result.text or not result.tool_calls:
        content.append({"type": "text", "text": result.text})
    for call in result.tool_calls:
        content.append({"type": "tool_use", "id": _tool_id(), "name": call.name, "input": tool_input(call.arguments)})
    reason, sequence = stop_reason(result.final)
    return JSONResponse(
        {
            "id": msg_id,
            "type": "message",
            "role": "assistant",
            "model": body.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage(result.final),
        }
    )


async def _stream(engine: LLMEngine, prepared: Any, msg_id: str, model: str, interval: float) -> AsyncIterator[str]:
    """The full Anthropic event sequence; a ping right away and every 10 s until output starts."""
    prompt_tokens = len(prepared.request.prompt_tokens)
    yield sse_event("message_start", {
        "type": "message_start",
        "message": {
            "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0,
                      "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0},
        },
    })
    yield sse_event("ping", {"type": "ping"})
    parser = prepared.new_parser()
    index = -1
    open_kind: str | None = None
    final: ChatFinal | None = None

    def close() -> list[str]:
        nonlocal open_kind
        out = []
        if open_kind == "thinking":
            out.append(sse_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                          "delta": {"type": "signature_delta", "signature": ""}}))
        if open_kind is not None:
            out.append(sse_event("content_block_stop", {"type": "content_block_stop", "index": index}))
        open_kind = None
        return out

    def start(kind: str, block: dict[str, Any]) -> list[str]:
        nonlocal index, open_kind
        out = close()
        index += 1
        open_kind = kind
        out.append(sse_event("content_block_start", {"type": "content_block_start", "index": index, "content_block": block}))
        return out

    try:
        async for item in with_keepalive(parsed_events(engine.generate(prepared.request), parser), interval):
            if item is KEEPALIVE:
                yield sse_event("ping", {"type": "ping"})
                continue
            deltas, ev = item  # type: ignore[misc]
            for d in deltas:
                if isinstance(d, ReasoningDelta):
                    if open_kind != "thinking":
                        for line in start("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                            yield line
                    yield sse_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                           "delta": {"type": "thinking_delta", "thinking": d.text}})
                elif isinstance(d, TextDelta):
                    if not d.text:
                        continue
                    if open_kind != "text":
                        for line in start("text", {"type": "text", "text": ""}):
                            yield line
                    yield sse_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                           "delta": {"type": "text_delta", "text": d.text}})
                elif isinstance(d, ToolCall):
                    for line in start("tool_use", {"type": "tool_use", "id": _tool_id(), "name": d.name, "input": {}}):
                        yield line
                    yield sse_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                           "delta": {"type": "input_json_delta", "partial_json": d.arguments}})
            if ev.finish_reason is not None:
                final = final_from(ev, parser)
    except Exception as exc:  # the stream has started: report in-band, Anthropic style
        kind = "invalid_request_error" if getattr(exc, "status", 500) == 400 else "api_error"
        yield sse_event("error", {"type": "error", "error": {"type": kind, "message": str(exc)}})
        return
    if index == -1:
        for line in start("text", {"type": "text", "text": ""}):
            yield line
    for line in close():
        yield line
    assert final is not None
    reason, sequence = stop_reason(final)
    yield sse_event("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": usage(final)})
    yield sse_event("message_stop", {"type": "message_stop"})


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    tools = tool_specs(body.tools)  # checked before the model is leased (or loaded)
    turn = ChatTurn(
        messages=to_chat_messages(body),
        tools=tools,
        tool_choice=tool_choice_name(body.tool_choice, tools),
        template_kwargs=thinking_kwargs(body.thinking),
    )
    tools = None if turn.tool_choice == "none" else turn.tools
    async with request.app.state.pool.lease(body.model, "llm") as (engine, _resolved):
        native = bool(tools) and template_supports_tools(engine.tokenizer)
        tokens = await asyncio.to_thread(render_turn, engine.tokenizer, turn, tools, native)
    return {"input_tokens": len(tokens)}
