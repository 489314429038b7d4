"""Anthropic Messages API: /v1/messages (streaming and not) and /v1/messages/count_tokens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from omlx.api.anthropic_models import (
    CountTokensRequest,
    MessagesRequest,
    thinking_budget,
    thinking_kwargs,
    to_chat_messages,
    tool_choice_name,
    tool_specs,
)
from omlx.api.media import MediaPolicy
from omlx.api.output_format import anthropic_output_format
from omlx.api.tool_prompt import template_supports_tools
from omlx.engine.llm_engine import LLMEngine
from omlx.pool.engine_pool import Resolved
from omlx.server.anthropic_events import MessageEvents
from omlx.server.chat_pipeline import (
    ChatFinal,
    ChatTurn,
    PreparedChat,
    final_from,
    parsed_events,
    prepare_chat,
    render_turn,
)
from omlx.server.openai_routes import default_max_tokens, media_policy, with_llm
from omlx.server.sse import KEEPALIVE, EventStream, sse_event, with_keepalive
from omlx.server.vision_prompt import expand, load_images, with_image_parts

router = APIRouter()


def _turn(body: MessagesRequest, media: MediaPolicy) -> ChatTurn:
    tools = tool_specs(body.tools)
    return ChatTurn(
        messages=to_chat_messages(body, media),
        tools=tools,
        tool_choice=tool_choice_name(body.tool_choice, tools),
        max_tokens=body.max_tokens,
        stop=list(body.stop_sequences or []),
        sampling={"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k},
        template_kwargs=thinking_kwargs(body.thinking),
        id_prefix="msg",
        output_format=anthropic_output_format(body.output_config, body.output_format),
        thinking_budget=thinking_budget(body.thinking),
        warnings=media.warnings,
        images=media.images,
        image_limits=media.limits,
    )


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    turn = _turn(body, media_policy(request, body.model))  # checked before the model is leased (or loaded)
    return await with_llm(request, body.model, lambda e, r: _messages(body, turn, request, e, r))


async def _messages(body: MessagesRequest, turn: ChatTurn, request: Request, engine: LLMEngine, resolved: Resolved):
    prepared = await prepare_chat(
        engine, resolved, turn, default_max_tokens(request, resolved.defaults), request.app.state.turn_memory
    )
    requests = [prepared.request]
    events = MessageEvents(prepared.request.request_id, body.model, len(prepared.request.prompt_tokens))
    engine.reserve(requests)
    if body.stream:
        return EventStream(
            _stream(engine, prepared, events, request.app.state.settings.keepalive_interval),
            on_close=lambda: engine.release(requests),
        )
    try:
        final = None
        parser = prepared.new_parser()
        async for deltas, ev in parsed_events(engine.generate(prepared.request), parser, prepared):
            events.feed(deltas)
            if ev.finish_reason is not None:
                final = final_from(ev, parser, prepared)
    finally:
        engine.release(requests)
    assert final is not None
    events.finish(final)
    return JSONResponse(events.message(final))


async def _stream(engine: LLMEngine, prepared: PreparedChat, events: MessageEvents, interval: float) -> AsyncIterator[str]:
    """The full Anthropic event sequence; pings every `interval` s until output starts."""
    for line in events.start():
        yield line
    final: ChatFinal | None = None
    try:
        parser = prepared.new_parser()
        async for item in with_keepalive(parsed_events(engine.generate(prepared.request), parser, prepared), interval):
            if item is KEEPALIVE:
                yield sse_event("ping", {"type": "ping"})
                continue
            deltas, ev = item  # type: ignore[misc]
            for line in events.feed(deltas):
                yield line
            if ev.finish_reason is not None:
                final = final_from(ev, parser, prepared)
    except Exception as exc:  # the stream has started: report in-band, Anthropic style
        kind = "invalid_request_error" if getattr(exc, "status", 500) == 400 else "api_error"
        yield sse_event("error", {"type": "error", "error": {"type": kind, "message": str(exc)}})
        return
    assert final is not None
    for line in events.finish(final):
        yield line


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request):
    tools = tool_specs(body.tools)  # checked before the model is leased (or loaded)
    media = media_policy(request, body.model)
    turn = ChatTurn(
        messages=to_chat_messages(body, media),
        tools=tools,
        tool_choice=tool_choice_name(body.tool_choice, tools),
        template_kwargs=thinking_kwargs(body.thinking),
    )
    tools = None if turn.tool_choice == "none" else turn.tools
    async with request.app.state.pool.lease(body.model, "llm") as (engine, _resolved):
        native = bool(tools) and template_supports_tools(engine.tokenizer)
        parts = getattr(engine.loaded, "vision", None)
        if media.images:  # counted as the prompt would hold them (vision_prompt.py)
            _, grid, digests = await load_images(media.images, media.limits, parts)
            turn = replace(turn, messages=with_image_parts(turn.messages))
        tokens, _ = await asyncio.to_thread(render_turn, engine.tokenizer, turn, tools, native)
        if media.images:
            tokens, _ = expand(tokens, parts, grid, digests)
    return {"input_tokens": len(tokens)}
