"""OpenAI Responses API: POST /v1/responses (streaming and not), GET/DELETE by id, chaining."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from omlx.api.output_format import responses_text_format
from omlx.api.responses_models import (
    ResponsesRequest,
    ResponseStore,
    function_tools,
    input_items,
    items_to_messages,
    tool_choice_name,
)
from omlx.api.tool_calls import ReasoningDelta, TextDelta, ToolCall
from omlx.engine.llm_engine import LLMEngine
from omlx.errors import InvalidRequestError, NotFoundError
from omlx.pool.engine_pool import Resolved
from omlx.server.chat_pipeline import ChatFinal, ChatTurn, final_from, parsed_events, prepare_chat
from omlx.server.generation import omlx_usage
from omlx.server.openai_routes import default_max_tokens, with_llm
from omlx.server.sse import KEEPALIVE, EventStream, sse_event, with_keepalive
from omlx.server.structured import effort_budget

router = APIRouter()


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def conversation_for(body: ResponsesRequest, store: ResponseStore) -> list[dict[str, Any]]:
    history: list[dict[str, Any]] = []
    if body.previous_response_id:
        found = store.get(body.previous_response_id)
        if found is None:
            raise InvalidRequestError(
                f"Previous response '{body.previous_response_id}' was not found (it may have expired).",
                param="previous_response_id",
            )
        history = [m for m in found[1] if m["role"] != "system"]
    return history + items_to_messages(input_items(body.input))


def _usage(final: ChatFinal) -> dict[str, Any]:
    return {
        "input_tokens": final.prompt_tokens,
        "input_tokens_details": {"cached_tokens": final.cached_tokens},
        "output_tokens": final.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": final.prompt_tokens + final.completion_tokens,
        **omlx_usage(final.cache),
    }


class ResponseBuilder:
    """Accumulates output items; also the source of the streamed events."""

    def __init__(self, body: ResponsesRequest):
        self.id = _id("resp")
        self.body = body
        self.created = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.text: dict[str, Any] | None = None
        self.reasoning: dict[str, Any] | None = None
        self.calls: list[ToolCall] = []

    def envelope(self, status: str, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": b.model, "output": self.output, "instructions": b.instructions,
            "previous_response_id": b.previous_response_id, "max_output_tokens": b.max_output_tokens,
            "temperature": b.temperature, "top_p": b.top_p, "tools": b.tools or [],
            "tool_choice": b.tool_choice or "auto", "parallel_tool_calls": True, "store": b.store,
            "metadata": b.metadata or {}, "usage": usage, "error": None, "incomplete_details": None,
            "text": self.text_config(), "reasoning": b.reasoning or {"effort": None, "summary": None},
        }

    def text_config(self) -> dict[str, Any]:
        """The `text` configuration asked for, echoed (its format is enforced)."""
        text = self.body.text if isinstance(self.body.text, dict) else {}
        return {**text, "format": text.get("format") or {"type": "text"}}

    def output_text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.output if i["type"] == "message")


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    messages = conversation_for(body, _store(request))  # checked before the model is leased
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    if not messages:
        raise InvalidRequestError("input must not be empty.", param="input")
    tools = function_tools(body.tools)
    turn = ChatTurn(
        messages=messages,
        tools=tools,
        tool_choice=tool_choice_name(body.tool_choice, tools),
        max_tokens=body.max_output_tokens,
        sampling={"temperature": body.temperature, "top_p": body.top_p},
        id_prefix="resp",
        output_format=responses_text_format(body.text),
        thinking_budget=effort_budget((body.reasoning or {}).get("effort"), "reasoning.effort"),
    )
    return await with_llm(request, body.model, lambda e, r: _create(body, turn, request, e, r))


async def _create(body: ResponsesRequest, turn: ChatTurn, request: Request, engine: LLMEngine, resolved: Resolved):
    messages = turn.messages
    prepared = await prepare_chat(engine, resolved, turn, default_max_tokens(request, resolved.defaults))
    builder = ResponseBuilder(body)
    store = _store(request)
    requests = [prepared.request]
    engine.reserve(requests)
    if body.stream:
        return EventStream(
            _stream(engine, prepared, builder, store, messages, request.app.state.settings.keepalive_interval),
            on_close=lambda: engine.release(requests),
        )
    try:
        async for _ in _run(engine, prepared, builder, interval=3600.0):
            pass
    finally:
        engine.release(requests)
    response = builder.final_response  # type: ignore[attr-defined]
    _remember(store, builder, messages, response)
    return JSONResponse(response)


def _remember(store: ResponseStore, builder: ResponseBuilder, messages: list[dict[str, Any]], response: dict[str, Any]) -> None:
    if not builder.body.store:
        return
    assistant: dict[str, Any] = {"role": "assistant", "content": builder.output_text()}
    if builder.calls:
        assistant["tool_calls"] = [
            {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            for item in builder.output if item["type"] == "function_call"
        ]
    store.put(response, [*messages, assistant])


async def _run(engine: LLMEngine, prepared: Any, builder: ResponseBuilder, interval: float) -> AsyncIterator[tuple[str, dict[str, Any]] | object]:
    """Yields (event name, payload) in Responses streaming order; sets builder.final_response."""
    seq = 0

    def ev(name: str, payload: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        nonlocal seq
        seq += 1
        return name, {"type": name, "sequence_number": seq, **payload}

    yield ev("response.created", {"response": builder.envelope("in_progress")})
    yield ev("response.in_progress", {"response": builder.envelope("in_progress")})
    parser = prepared.new_parser()
    final: ChatFinal | None = None
    current: dict[str, Any] | None = None  # the open output item (message or reasoning)

    def close_current() -> list[tuple[str, dict[str, Any]]]:
        nonlocal current
        out = []
        if current is None:
            return out
        idx = builder.output.index(current)
        if current["type"] == "message":
            part = current["content"][0]
            out.append(ev("response.output_text.done", {"item_id": current["id"], "output_index": idx,
                                                         "content_index": 0, "text": part["text"]}))
            out.append(ev("response.content_part.done", {"item_id": current["id"], "output_index": idx,
                                                          "content_index": 0, "part": part}))
        current["status"] = "completed"
        out.append(ev("response.output_item.done", {"output_index": idx, "item": current}))
        current = None
        return out

    async for item in with_keepalive(parsed_events(engine.generate(prepared.request), parser), interval):
        if item is KEEPALIVE:
            yield KEEPALIVE
            continue
        deltas, gev = item  # type: ignore[misc]
        for d in deltas:
            if isinstance(d, ReasoningDelta):
                if current is None or current["type"] != "reasoning":
                    for e in close_current():
                        yield e
                    current = {"id": _id("rs"), "type": "reasoning", "status": "in_progress", "summary": [],
                               "content": [{"type": "reasoning_text", "text": ""}]}
                    builder.output.append(current)
                    yield ev("response.output_item.added", {"output_index": len(builder.output) - 1, "item": current})
                current["content"][0]["text"] += d.text
                yield ev("response.reasoning_text.delta", {"item_id": current["id"], "output_index": builder.output.index(current),
                                                           "content_index": 0, "delta": d.text})
            elif isinstance(d, TextDelta):
                if not d.text:
                    continue
                if current is None or current["type"] != "message":
                    for e in close_current():
                        yield e
                    current = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                               "content": [{"type": "output_text", "text": "", "annotations": []}]}
                    builder.output.append(current)
                    idx = len(builder.output) - 1
                    yield ev("response.output_item.added", {"output_index": idx, "item": {**current, "content": []}})
                    yield ev("response.content_part.added", {"item_id": current["id"], "output_index": idx,
                                                              "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}})
                current["content"][0]["text"] += d.text
                yield ev("response.output_text.delta", {"item_id": current["id"], "output_index": builder.output.index(current),
                                                        "content_index": 0, "delta": d.text})
            elif isinstance(d, ToolCall):
                for e in close_current():
                    yield e
                builder.calls.append(d)
                call = {"id": _id("fc"), "type": "function_call", "status": "in_progress", "call_id": d.id,
                        "name": d.name, "arguments": ""}
                builder.output.append(call)
                idx = len(builder.output) - 1
                yield ev("response.output_item.added", {"output_index": idx, "item": call})
                yield ev("response.function_call_arguments.delta", {"item_id": call["id"], "output_index": idx, "delta": d.arguments})
                call["arguments"] = d.arguments
                yield ev("response.function_call_arguments.done", {"item_id": call["id"], "output_index": idx, "arguments": d.arguments})
                call["status"] = "completed"
                yield ev("response.output_item.done", {"output_index": idx, "item": call})
        if gev.finish_reason is not None:
            final = final_from(gev, parser)
    for e in close_current():
        yield e
    assert final is not None
    status = "incomplete" if final.finish_reason == "length" else "completed"
    response = builder.envelope(status, _usage(final))
    if status == "incomplete":
        response["incomplete_details"] = {"reason": "max_output_tokens"}
    builder.final_response = response  # type: ignore[attr-defined]
    yield ev("response.completed" if status == "completed" else "response.incomplete", {"response": response})


async def _stream(engine: LLMEngine, prepared: Any, builder: ResponseBuilder, store: ResponseStore,
                  messages: list[dict[str, Any]], interval: float) -> AsyncIterator[str]:
    try:
        async for item in _run(engine, prepared, builder, interval):
            if item is KEEPALIVE:
                yield ": keep-alive\n\n"
                continue
            name, payload = item  # type: ignore[misc]
            yield sse_event(name, payload)
    except Exception as exc:  # the stream has started: report in-band
        kind = getattr(exc, "error_type", "server_error")
        yield sse_event("error", {"type": "error", "code": kind, "message": str(exc), "param": None})
        return
    _remember(store, builder, messages, builder.final_response)  # type: ignore[attr-defined]


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    found = _store(request).get(response_id)
    if found is None:
        raise NotFoundError(f"Response '{response_id}' was not found.")
    return found[0]


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    if not _store(request).delete(response_id):
        raise NotFoundError(f"Response '{response_id}' was not found.")
    return {"id": response_id, "object": "response.deleted", "deleted": True}
