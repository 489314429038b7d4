"""Anthropic Messages API: /v1/messages (streaming and not) and /v1/messages/count_tokens."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
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
    tool_specs,
)
from omlx.api.media import MediaPolicy
from omlx.api.output_format import anthropic_output_format
from omlx.api.tool_calls import ToolCall
from omlx.api.tool_prompt import template_supports_tools
from omlx.engine.llm_engine import LLMEngine
from omlx.engine.request import new_request_id
from omlx.pool.engine_pool import Resolved
from omlx.server.anthropic_events import MessageEvents, tool_input, tool_use_id
from omlx.server.chat_pipeline import (
    ChatFinal,
    ChatTurn,
    PreparedChat,
    final_from,
    parsed_events,
    prepare_chat,
    render_turn,
)
from omlx.server.mcp_loop import (
    LoopOptions,
    LoopResult,
    Ran,
    Started,
    Step,
    loop_options,
    offered,
    primed,
    run_tool_loop_from,
    summed,
    tool_loop,
)
from omlx.server.ocr_prompt import ocr_prompt
from omlx.server.openai_routes import default_max_tokens, media_policy, with_llm
from omlx.server.sse import KEEPALIVE, EventStream, sse_event, with_keepalive
from omlx.server.vision_prompt import expand, load_images, with_image_parts

router = APIRouter()


def _turn(body: MessagesRequest, media: MediaPolicy, mcp_tools: list[dict[str, Any]] | None = None) -> ChatTurn:
    tools = tool_specs(body.tools)
    if mcp_tools:  # the MCP tool loop's, besides the request's own
        tools = [*(tools or []), *mcp_tools]
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
    loop = loop_options(body.mcp, request.app.state.settings.mcp_max_rounds)
    if loop is not None:
        loop.tools = offered(getattr(request.app.state, "mcp", None), loop, tool_specs(body.tools))
        turn = _turn(body, media_policy(request, body.model), [t.spec() for t in loop.tools])
        return await with_llm(request, body.model, lambda e, r: _messages_loop(body, turn, loop, request, e, r))
    turn = _turn(body, media_policy(request, body.model))  # checked before the model is leased (or loaded)
    return await with_llm(request, body.model, lambda e, r: _messages(body, turn, request, e, r))


def anthropic_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tool loop's added chat messages as Messages turns: the answer's blocks, then one user
    turn of tool_result blocks."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant":
            blocks: list[dict[str, Any]] = []
            if m.get("reasoning_content"):
                blocks.append({"type": "thinking", "thinking": m["reasoning_content"], "signature": ""})
            if m.get("content"):
                blocks.append({"type": "text", "text": m["content"]})
            for c in m.get("tool_calls") or []:
                call = ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
                blocks.append({"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": tool_input(call)})
            out.append({"role": "assistant", "content": blocks})
        else:
            result = {"type": "tool_result", "tool_use_id": "toolu_" + m["tool_call_id"].removeprefix("call_"),
                      "content": m["content"]}  # fmt: skip
            if out and out[-1]["role"] == "user":
                out[-1]["content"].append(result)
            else:
                out.append({"role": "user", "content": [result]})
    return out


async def _messages_loop(body: MessagesRequest, turn: ChatTurn, loop: LoopOptions, request: Request,
                         engine: LLMEngine, resolved: Resolved):
    """The message after the server ran the MCP tools the model called; `mcp` says what it added."""
    state = request.app.state
    steps = tool_loop(engine, resolved, turn, getattr(state, "mcp", None), loop,
                      default_max_tokens(request, resolved.defaults), state.turn_memory)
    if body.stream:
        return EventStream(_stream_loop(await primed(steps), body.model, state.settings.keepalive_interval))
    done = await run_tool_loop_from(steps)
    events = MessageEvents(done.request_id, body.model, done.rounds[-1]["prompt_tokens"])
    events.feed(done.result.deltas)
    message = events.message(summed(done))
    message["mcp"] = {"rounds": done.rounds, "messages": anthropic_messages(done.messages)}
    return JSONResponse(message)


async def _stream_loop(steps: AsyncIterator[Any], model: str, interval: float) -> AsyncIterator[str]:
    """The tool loop as one message's events: every round's text and thinking as they come, a
    round's calls only when they go back to the client, and each round the server ran as an
    `mcp` event (`{"type": "mcp", "messages": [...]}`), which SDKs skip."""
    events: MessageEvents | None = None
    held: list[ToolCall] = []
    try:
        async for item in with_keepalive(steps, interval):
            if isinstance(item, Started) and events is None:
                events = MessageEvents(new_request_id("msg"), model, item.prompt_tokens)
                for line in events.start():
                    yield line
            elif events is None:
                continue
            elif item is KEEPALIVE:
                yield sse_event("ping", {"type": "ping"})
            elif isinstance(item, Step):
                held += [d for d in item.deltas if isinstance(d, ToolCall)]
                for line in events.feed([d for d in item.deltas if not isinstance(d, ToolCall)]):
                    yield line
            elif isinstance(item, Ran):
                held = []
                yield sse_event("mcp", {"type": "mcp", "messages": anthropic_messages(item.messages)})
            elif isinstance(item, LoopResult):
                for line in events.feed(held):
                    yield line
                for line in events.finish(summed(item)):
                    yield line
    except Exception as exc:  # the stream has started: report in-band, Anthropic style
        kind = "invalid_request_error" if getattr(exc, "status", 500) == 400 else "api_error"
        yield sse_event("error", {"type": "error", "error": {"type": kind, "message": str(exc)}})


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
        if parts is not None and parts.ocr is not None:  # DeepSeek-OCR: its processor lays out the prompt
            tokens, _ = await ocr_prompt(engine, parts, turn.messages, media.images, media.limits)
            return {"input_tokens": len(tokens)}
        if media.images:  # counted as the prompt would hold them (vision_prompt.py)
            _, grid, digests = await load_images(media.images, media.limits, parts)
            turn = replace(turn, messages=with_image_parts(turn.messages))
        tokens, _ = await asyncio.to_thread(render_turn, engine.tokenizer, turn, tools, native)
        if media.images:
            tokens, _ = expand(tokens, parts, grid, digests)
    return {"input_tokens": len(tokens)}
