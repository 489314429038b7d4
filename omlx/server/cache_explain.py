"""`POST /api/cache/explain`: what a request would restore from the prefix cache, from which tier, and why
not more — without running it. The prompt is rendered as a chat or completion request renders it, and
the answer comes from the engine's own `match` and `report`, on its engine thread (no read, no MLX
array: docs/design/cache-explain.md)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field

from omlx.api.openai_models import ChatCompletionRequest, ChatMessage
from omlx.api.wire import Lenient
from omlx.cache.plan.why import explain, plan_dict, template_rewrote
from omlx.engine.vision_input import image_keys
from omlx.errors import InvalidRequestError
from omlx.server.chat_pipeline import render_prompt
from omlx.server.openai_chat import chat_turn
from omlx.server.openai_routes import media_policy

router = APIRouter(prefix="/api")


class CacheExplainBody(Lenient):
    """A chat completion's or a completion's request body (other fields are ignored): `messages` (with
    `tools`, `tool_choice`, `chat_template_kwargs`) or `prompt` (text or token ids)."""

    model: str
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    prompt: str | list[int] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def explain_on_engine(
    engine: Any, tokens: list[int], rewritten: int = 0, image_keys: dict[int, bytes] | None = None
) -> dict[str, Any]:
    """On the engine's thread: the plan its scheduler would make for `tokens` (with its images'
    `image_keys`) and its report (`rewritten`: earlier answers the chat template rewrote, as the
    runner reads it)."""
    cache = engine.prefix_cache
    plan = cache.match(tokens, grid=engine.prefill_quantum, image_keys=image_keys)
    return {**template_rewrote(explain(plan), rewritten).to_dict(), "plan": plan_dict(plan)}


async def prompt_tokens(
    engine: Any, resolved: Any, body: CacheExplainBody, request: Request
) -> tuple[list[int], int, dict[int, bytes] | None]:
    """The tokens the request would send to the engine: its messages rendered as the chat route
    renders them (the same turn, media policy and turn memory), or its prompt; with how many
    earlier answers the template rewrote and its images' keys."""
    if body.messages is not None:
        chat = ChatCompletionRequest(model=body.model, messages=body.messages, tools=body.tools,
                                     tool_choice=body.tool_choice, chat_template_kwargs=body.chat_template_kwargs)  # fmt: skip
        turn = chat_turn(chat, media_policy(request, body.model))
        rendered = await render_prompt(engine, resolved, turn, request.app.state.turn_memory)
        return rendered.tokens, rendered.rewritten, image_keys(rendered.vision)
    if isinstance(body.prompt, str):
        tokens = list(await asyncio.to_thread(engine.tokenizer.encode, body.prompt))
    else:
        tokens = list(body.prompt or [])
        vocab = engine.model_vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise InvalidRequestError(f"prompt has token ids outside the vocabulary (0..{vocab - 1}).", param="prompt")
    if not tokens:
        raise InvalidRequestError("prompt must not be empty.", param="prompt")
    return tokens, 0, None


@router.post("/cache/explain")
async def cache_explain(body: CacheExplainBody, request: Request) -> dict[str, Any]:
    """Loads the model if it is not loaded, as a request (or `count_tokens`) would."""
    if (body.messages is None) == (body.prompt is None):  # before a model is leased (or loaded)
        raise InvalidRequestError("Give exactly one of messages or prompt.", param="messages")
    async with request.app.state.pool.lease(body.model, "llm") as (engine, resolved):
        tokens, rewritten, image_keys = await prompt_tokens(engine, resolved, body, request)
        answer = await engine.call(lambda: explain_on_engine(engine, tokens, rewritten, image_keys))
        return {"model": resolved.info.id, "prompt_tokens": len(tokens), **answer}
