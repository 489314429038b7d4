"""OpenAI Responses API: POST /v1/responses (streaming and not), GET/DELETE by id, chaining."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from omlx.api.media import MediaPolicy
from omlx.api.output_format import responses_text_format
from omlx.api.responses_models import (
    ResponsesRequest,
    ResponseStore,
    function_tools,
    input_items,
    items_to_messages,
    tool_choice_name,
)
from omlx.engine.llm_engine import LLMEngine
from omlx.errors import InvalidRequestError, NotFoundError
from omlx.pool.engine_pool import Resolved
from omlx.server.chat_pipeline import (
    ChatFinal,
    ChatTurn,
    PreparedChat,
    final_from,
    parsed_events,
    prepare_chat,
)
from omlx.server.openai_routes import default_max_tokens, media_policy, with_llm
from omlx.server.responses_events import Event, ResponseEvents
from omlx.server.sse import KEEPALIVE, EventStream, sse_event, with_keepalive
from omlx.server.structured import effort_budget
from omlx.server.vision_prompt import images_apart, with_images

router = APIRouter()


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


def conversation_for(body: ResponsesRequest, store: ResponseStore, media: MediaPolicy) -> list[dict[str, Any]]:
    history: list[dict[str, Any]] = []
    if body.previous_response_id:
        found = store.get(body.previous_response_id)
        if found is None:
            raise InvalidRequestError(
                f"Previous response '{body.previous_response_id}' was not found (it may have expired).",
                param="previous_response_id",
            )
        history = [m for m in found[1] if m["role"] != "system"]
    history, images = images_apart(history)  # a stored turn's images come back with it
    new = items_to_messages(input_items(body.input), media)
    media.images[:0] = images
    return history + new


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request):
    if (body.model_extra or {}).get("mcp") not in (None, False):  # not silently ignored
        raise InvalidRequestError("The MCP tool loop (\"mcp\") runs on /v1/chat/completions and /v1/messages, "
                                  "not yet on /v1/responses.", param="mcp")
    media = media_policy(request, body.model)
    messages = conversation_for(body, _store(request), media)  # checked before the model is leased
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
        thinking_budget=(
            body.thinking_budget if body.thinking_budget is not None
            else effort_budget((body.reasoning or {}).get("effort"), "reasoning.effort")
        ),
        warnings=media.warnings,
        images=media.images,
        image_limits=media.limits,
    )
    return await with_llm(request, body.model, lambda e, r: _create(body, turn, request, e, r))


async def _create(body: ResponsesRequest, turn: ChatTurn, request: Request, engine: LLMEngine, resolved: Resolved):
    messages = with_images(turn.messages, turn.images)  # as stored for previous_response_id
    prepared = await prepare_chat(
        engine, resolved, turn, default_max_tokens(request, resolved.defaults), request.app.state.turn_memory
    )
    events = ResponseEvents(body)
    store = _store(request)
    requests = [prepared.request]
    engine.reserve(requests)
    if body.stream:
        return EventStream(
            _stream(engine, prepared, events, store, messages, request.app.state.settings.keepalive_interval),
            on_close=lambda: engine.release(requests),
        )
    try:
        async for _ in _run(engine, prepared, events, interval=3600.0):
            pass
    finally:
        engine.release(requests)
    assert events.final_response is not None
    _remember(store, events, messages)
    return JSONResponse(events.final_response)


def _remember(store: ResponseStore, events: ResponseEvents, messages: list[dict[str, Any]]) -> None:
    if not events.body.store or events.final_response is None:
        return
    assistant: dict[str, Any] = {"role": "assistant", "content": events.output_text()}
    if events.calls:
        assistant["tool_calls"] = [
            {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            for item in events.output if item["type"] == "function_call"
        ]
    store.put(events.final_response, [*messages, assistant])


async def _run(engine: LLMEngine, prepared: PreparedChat, events: ResponseEvents,
               interval: float) -> AsyncIterator[Event | object]:
    """(event name, payload) pairs in Responses streaming order, KEEPALIVE while nothing comes."""
    for e in events.start():
        yield e
    parser = prepared.new_parser()
    final: ChatFinal | None = None
    async for item in with_keepalive(parsed_events(engine.generate(prepared.request), parser, prepared), interval):
        if item is KEEPALIVE:
            yield KEEPALIVE
            continue
        deltas, gev = item  # type: ignore[misc]
        for e in events.feed(deltas):
            yield e
        if gev.finish_reason is not None:
            final = final_from(gev, parser, prepared)
    assert final is not None
    for e in events.finish(final):
        yield e


async def _stream(engine: LLMEngine, prepared: PreparedChat, events: ResponseEvents, store: ResponseStore,
                  messages: list[dict[str, Any]], interval: float) -> AsyncIterator[str]:
    try:
        async for item in _run(engine, prepared, events, interval):
            if item is KEEPALIVE:
                yield ": keep-alive\n\n"
                continue
            name, payload = item  # type: ignore[misc]
            yield sse_event(name, payload)
    except Exception as exc:  # the stream has started: report in-band
        kind = getattr(exc, "error_type", "server_error")
        yield sse_event("error", {"type": "error", "code": kind, "message": str(exc), "param": None})
        return
    _remember(store, events, messages)


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
