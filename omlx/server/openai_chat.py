"""OpenAI chat completions on the shared chat pipeline: tool_calls and reasoning_content."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from omlx.api.chat_template import content_text, normalize_tool_calls
from omlx.api.media import MediaPolicy
from omlx.api.openai_models import ChatCompletionRequest
from omlx.api.output_format import openai_response_format
from omlx.api.tool_calls import ToolCall
from omlx.api.tool_specs import openai_tool_choice, openai_tools
from omlx.engine.llm_engine import LLMEngine
from omlx.engine.request import GenerationRequest, new_request_id
from omlx.errors import InvalidRequestError, OMLXError
from omlx.pool.engine_pool import Resolved
from omlx.server.chat_chunks import ChatChunks, chat_usage
from omlx.server.chat_pipeline import (
    ChatFinal,
    ChatTurn,
    PreparedChat,
    final_from,
    parsed_events,
    prepare_chat,
    run_chat,
)
from omlx.server.generation import SAMPLING_FIELDS, fan_out, usage_dict
from omlx.server.mcp_loop import (
    LoopOptions,
    LoopResult,
    Ran,
    Step,
    loop_options,
    offered,
    primed,
    run_tool_loop,
    tool_loop,
)
from omlx.server.openai_routes import chat_logprobs, default_max_tokens, media_policy, with_llm
from omlx.server.sse import KEEPALIVE, EventStream, sse_data, with_keepalive
from omlx.server.structured import effort_budget

router = APIRouter()


def chat_messages(req: ChatCompletionRequest, media: MediaPolicy) -> list[dict[str, Any]]:
    """OpenAI messages → HF chat-template messages (`media` collects the warnings)."""
    out = []
    for i, m in enumerate(req.messages):
        role = "system" if m.role == "developer" else ("tool" if m.role == "function" else m.role)
        content = content_text(m.content, f"messages.{i}.content", media, in_tool_result=role == "tool")
        msg: dict[str, Any] = {"role": role, "content": content}
        calls = normalize_tool_calls(m.tool_calls, f"messages.{i}.tool_calls")
        if calls:
            msg["tool_calls"] = calls
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.name:
            msg["name"] = m.name
        if m.reasoning_content:
            msg["reasoning_content"] = m.reasoning_content
        out.append(msg)
    return out


def chat_turn(
    body: ChatCompletionRequest, media: MediaPolicy, mcp_tools: list[dict[str, Any]] | None = None
) -> ChatTurn:
    """The request as a chat turn, checked before any model is leased; `mcp_tools` are offered
    besides the request's own (the MCP tool loop)."""
    tools = openai_tools(body.tools)
    if mcp_tools:
        tools = [*(tools or []), *mcp_tools]
    return ChatTurn(
        messages=chat_messages(body, media),
        tools=tools,
        tool_choice=openai_tool_choice(body.tool_choice, tools),
        max_tokens=body.max_completion_tokens or body.max_tokens,
        stop=body.stop_list(),
        sampling={k: getattr(body, k) for k in SAMPLING_FIELDS},
        seed=body.seed,
        logit_bias=body.logit_bias,
        template_kwargs=dict(body.chat_template_kwargs or {}),
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        output_format=openai_response_format(body.response_format),
        thinking_budget=(
            body.thinking_budget if body.thinking_budget is not None
            else effort_budget(body.reasoning_effort, "reasoning_effort")
        ),
        warnings=media.warnings,
        images=media.images,
        image_limits=media.limits,
    )


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    if (body.max_completion_tokens or body.max_tokens) == 0:
        raise InvalidRequestError("max_tokens must be at least 1.", param="max_tokens")
    loop = loop_options(body.mcp, request.app.state.settings.mcp_max_rounds)
    if loop is not None:
        if body.n > 1:
            raise InvalidRequestError("The MCP tool loop (\"mcp\") takes n 1.", param="mcp")
        loop.tools = offered(getattr(request.app.state, "mcp", None), loop, openai_tools(body.tools))
        turn = chat_turn(body, media_policy(request, body.model), [t.spec() for t in loop.tools])
        return await with_llm(request, body.model, lambda e, r: _chat_loop(body, turn, loop, request, e, r))
    turn = chat_turn(body, media_policy(request, body.model))
    return await with_llm(request, body.model, lambda e, r: _chat(body, turn, request, e, r))


async def _chat_loop(body: ChatCompletionRequest, turn: ChatTurn, loop: LoopOptions, request: Request,
                     engine: LLMEngine, resolved: Resolved) -> JSONResponse:
    """The answer after the server ran the MCP tools the model called; `mcp` says what it added."""
    state = request.app.state
    args = (engine, resolved, turn, getattr(state, "mcp", None), loop, default_max_tokens(request, resolved.defaults),
            state.turn_memory)  # fmt: skip
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        steps = await primed(tool_loop(*args))
        return EventStream(_stream_loop(steps, body.model, include_usage, state.settings.keepalive_interval))
    done = await run_tool_loop(*args)
    created = int(time.time())
    rid = done.request_id
    chunks = ChatChunks(rid, body.model, created)
    chunks.feed(0, done.result.deltas)
    final = done.result.final
    final.warnings = [*final.warnings, *done.warnings]
    lp = chat_logprobs(engine.tokenizer, [x for ev in done.result.events for x in ev.logprobs]) if body.logprobs else None
    usage = _loop_usage(done.rounds)
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": body.model,
        "system_fingerprint": None, "choices": [chunks.choice_body(0, final, lp)], "usage": usage,
        "mcp": {"rounds": done.rounds, "messages": done.messages},
    })


async def _chat(body: ChatCompletionRequest, turn: ChatTurn, request: Request, engine: LLMEngine, resolved: Resolved):
    prepared = await prepare_chat(
        engine, resolved, turn, default_max_tokens(request, resolved.defaults), request.app.state.turn_memory
    )
    requests = fan_out(prepared.request, body.n)
    created = int(time.time())
    rid = prepared.request.request_id
    engine.reserve(requests)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStream(
            _stream(engine, prepared, requests, rid, body.model, created, include_usage,
                    request.app.state.settings.keepalive_interval),
            on_close=lambda: engine.release(requests),
        )
    try:
        results = await asyncio.gather(*(run_chat(engine, prepared, r) for r in requests))
    finally:
        engine.release(requests)
    chunks = ChatChunks(rid, body.model, created, n=len(results))
    choices = []
    for i, result in enumerate(results):
        chunks.feed(i, result.deltas)
        lp = None
        if body.logprobs:
            lp = chat_logprobs(engine.tokenizer, [x for ev in result.events for x in ev.logprobs])
        choices.append(chunks.choice_body(i, result.final, lp))
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": body.model,
        "system_fingerprint": None, "choices": choices, "usage": chat_usage([r.final for r in results]),
    })


async def _one_stream(engine: LLMEngine, prepared: PreparedChat, req: GenerationRequest, index: int,
                      queue: asyncio.Queue) -> None:
    parser = prepared.new_parser()
    try:
        async for deltas, ev in parsed_events(engine.generate(req), parser, prepared):
            final = final_from(ev, parser, prepared) if ev.finish_reason else None
            await queue.put((index, deltas, ev, final, None))
    except Exception as exc:  # reported in-band by the consumer
        await queue.put((index, [], None, None, exc))
    finally:
        await queue.put((index, None, None, None, None))


async def _merged(engine: LLMEngine, prepared: PreparedChat, requests: list[GenerationRequest]) -> AsyncIterator[tuple]:
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_one_stream(engine, prepared, r, i, queue)) for i, r in enumerate(requests)]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item[1] is None:
                remaining -= 1
                continue
            yield item
    finally:
        for t in tasks:
            t.cancel()


async def _stream(engine: LLMEngine, prepared: PreparedChat, requests: list[GenerationRequest], rid: str,
                  model: str, created: int, include_usage: bool, interval: float) -> AsyncIterator[str]:
    chunks = ChatChunks(rid, model, created, n=len(requests), include_usage=include_usage)
    for line in chunks.start():
        yield line
    finals: list[ChatFinal | None] = [None] * len(requests)
    want_logprobs = requests[0].logprobs is not None
    async for item in with_keepalive(_merged(engine, prepared, requests), interval):
        if item is KEEPALIVE:
            yield ": keep-alive\n\n"
            continue
        i, deltas, ev, final, error = item  # type: ignore[misc]
        if error is not None:
            kind = getattr(error, "error_type", "server_error")
            yield sse_data({"error": {"message": str(error), "type": kind, "param": None, "code": None}})
            return
        lp = chat_logprobs(engine.tokenizer, ev.logprobs) if want_logprobs and ev.logprobs else None
        for line in chunks.feed(i, deltas, lp):
            yield line
        if final is not None:
            finals[i] = final
            for line in chunks.finish(i, final):
                yield line
    for line in chunks.end(finals):
        yield line


def _loop_usage(rounds: list[dict[str, int]]) -> dict[str, Any]:
    """Every round's tokens added up."""
    return usage_dict(*(sum(r[k] for r in rounds) for k in ("prompt_tokens", "completion_tokens", "cached_tokens")))


async def _stream_loop(steps: AsyncIterator[Step | Ran | LoopResult], model: str, include_usage: bool,
                       interval: float) -> AsyncIterator[str]:
    """The tool loop as one chunk stream: every round's text and reasoning as they come; a
    round's calls only once the round ends (as `tool_calls` when they go back to the client);
    each round the server ran as a chunk whose `mcp.messages` hold its answer and results."""
    chunks = ChatChunks(new_request_id("chatcmpl"), model, int(time.time()), include_usage=include_usage)
    for line in chunks.start():
        yield line
    held: list[ToolCall] = []
    try:
        async for item in with_keepalive(steps, interval):
            if item is KEEPALIVE:
                yield ": keep-alive\n\n"
            elif isinstance(item, Step):
                held += [d for d in item.deltas if isinstance(d, ToolCall)]
                for line in chunks.feed(0, [d for d in item.deltas if not isinstance(d, ToolCall)]):
                    yield line
            elif isinstance(item, Ran):
                held = []
                payload = json.loads(chunks.chunk([])[len("data: "):])
                payload["mcp"] = {"messages": item.messages}
                yield sse_data(payload)
            elif isinstance(item, LoopResult):
                for line in chunks.feed(0, held):
                    yield line
                final = item.result.final
                final.warnings = [*final.warnings, *item.warnings]
                for line in chunks.finish(0, final):
                    yield line
                if include_usage:
                    yield chunks.chunk([], _loop_usage(item.rounds))
                yield "data: [DONE]\n\n"
    except OMLXError as exc:
        yield sse_data({"error": {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": exc.code}})
