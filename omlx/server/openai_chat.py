"""OpenAI chat completions on the shared chat pipeline: tool_calls and reasoning_content."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from omlx.api.chat_template import content_text, normalize_tool_calls
from omlx.api.openai_models import ChatCompletionRequest
from omlx.api.output_format import openai_response_format
from omlx.api.tool_calls import ReasoningDelta, TextDelta, ToolCall
from omlx.api.tool_specs import openai_tool_choice, openai_tools
from omlx.engine.llm_engine import LLMEngine
from omlx.engine.request import GenerationRequest
from omlx.errors import InvalidRequestError
from omlx.pool.engine_pool import Resolved
from omlx.server.chat_pipeline import (
    ChatFinal,
    ChatResult,
    ChatTurn,
    PreparedChat,
    final_from,
    parsed_events,
    prepare_chat,
    run_chat,
)
from omlx.server.generation import SAMPLING_FIELDS, fan_out, usage_dict
from omlx.server.openai_routes import chat_logprobs, default_max_tokens, with_llm
from omlx.server.sse import KEEPALIVE, EventStream, sse_data, with_keepalive
from omlx.server.structured import effort_budget

router = APIRouter()


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """OpenAI messages → HF chat-template messages."""
    out = []
    for i, m in enumerate(req.messages):
        role = "system" if m.role == "developer" else ("tool" if m.role == "function" else m.role)
        msg: dict[str, Any] = {"role": role, "content": content_text(m.content, f"messages.{i}.content")}
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


def _turn(body: ChatCompletionRequest) -> ChatTurn:
    """The request as a chat turn, checked before any model is leased."""
    tools = openai_tools(body.tools)
    return ChatTurn(
        messages=chat_messages(body),
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
    )


def _tool_call_json(call: ToolCall, index: int) -> dict[str, Any]:
    return {"index": index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _message(result: ChatResult) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": result.text if (result.text or not result.tool_calls) else None}
    if result.reasoning:
        msg["reasoning_content"] = result.reasoning
    if result.tool_calls:
        msg["tool_calls"] = [{k: v for k, v in _tool_call_json(c, i).items() if k != "index"}
                             for i, c in enumerate(result.tool_calls)]
    return msg


def _usage(finals: list[ChatFinal]) -> dict[str, Any]:
    return usage_dict(finals[0].prompt_tokens, sum(f.completion_tokens for f in finals), finals[0].cached_tokens, finals[0].cache)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    if (body.max_completion_tokens or body.max_tokens) == 0:
        raise InvalidRequestError("max_tokens must be at least 1.", param="max_tokens")
    turn = _turn(body)
    return await with_llm(request, body.model, lambda e, r: _chat(body, turn, request, e, r))


async def _chat(body: ChatCompletionRequest, turn: ChatTurn, request: Request, engine: LLMEngine, resolved: Resolved):
    prepared = await prepare_chat(engine, resolved, turn, default_max_tokens(request, resolved.defaults))
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
    choices = []
    for i, result in enumerate(results):
        lp = None
        if body.logprobs:
            lp = chat_logprobs(engine.tokenizer, [x for ev in result.events for x in ev.logprobs])
        choices.append({"index": i, "message": _message(result), "logprobs": lp,
                        "finish_reason": result.final.finish_reason})
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": body.model,
        "system_fingerprint": None, "choices": choices, "usage": _usage([r.final for r in results]),
    })


async def _one_stream(engine: LLMEngine, prepared: PreparedChat, req: GenerationRequest, index: int,
                      queue: asyncio.Queue) -> None:
    parser = prepared.new_parser()
    try:
        async for deltas, ev in parsed_events(engine.generate(req), parser):
            await queue.put((index, deltas, ev, final_from(ev, parser) if ev.finish_reason else None, None))
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
    def chunk(choices: list[dict[str, Any]], usage: Any = None, last: bool = False) -> str:
        payload: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                   "system_fingerprint": None, "choices": choices}
        if include_usage:
            payload["usage"] = usage
        return sse_data(payload)

    for i in range(len(requests)):
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
    finals: list[ChatFinal | None] = [None] * len(requests)
    call_counts = [0] * len(requests)
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
        for d in deltas:
            if isinstance(d, TextDelta) and d.text:
                delta: dict[str, Any] = {"content": d.text}
            elif isinstance(d, ReasoningDelta) and d.text:
                delta = {"reasoning_content": d.text}
            elif isinstance(d, ToolCall):
                delta = {"tool_calls": [_tool_call_json(d, call_counts[i])]}
                call_counts[i] += 1
            else:
                continue
            yield chunk([{"index": i, "delta": delta, "logprobs": lp, "finish_reason": None}])
            lp = None
        if lp is not None:
            yield chunk([{"index": i, "delta": {}, "logprobs": lp, "finish_reason": None}])
        if final is not None:
            finals[i] = final
            yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": final.finish_reason}])
    if include_usage and all(finals):
        yield chunk([], _usage(finals))  # type: ignore[arg-type]
    yield "data: [DONE]\n\n"

