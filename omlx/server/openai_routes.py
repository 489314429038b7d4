"""OpenAI-compatible routes: chat completions, completions, models."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from omlx.api.images import ImageLimits
from omlx.api.media import MediaPolicy
from omlx.api.openai_models import CompletionRequest, SamplingFields
from omlx.api.output_format import completion_format
from omlx.engine.llm_engine import LLMEngine
from omlx.engine.request import GenerationRequest, SamplingParams, TokenLogprob, new_request_id
from omlx.errors import InvalidRequestError
from omlx.pool.engine_pool import Resolved
from omlx.pool.model_settings import GenerationDefaults
from omlx.server.disconnect import unless_disconnected
from omlx.server.generation import (
    SAMPLING_FIELDS,
    Collected,
    collect,
    completion_budget,
    fan_out,
    merged,
    sampling_params,
    usage_dict,
)
from omlx.server.log_setup import bind
from omlx.server.sse import KEEPALIVE, EventStream, sse_data, with_keepalive
from omlx.server.structured import build_constraint

router = APIRouter()


def sampling_from(req: SamplingFields, vocab_size: int, defaults: GenerationDefaults) -> SamplingParams:
    """Request values override the model's (or profile's) defaults."""
    values = {name: getattr(req, name) for name in SAMPLING_FIELDS}
    return sampling_params(values, defaults, seed=req.seed, logit_bias=req.logit_bias, vocab_size=vocab_size)


def _token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token])


def chat_logprobs(tokenizer: Any, items: list[TokenLogprob]) -> dict[str, Any]:
    def entry(tok: int, lp: float) -> dict[str, Any]:
        text = _token_text(tokenizer, tok)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**entry(i.token, i.logprob), "top_logprobs": [entry(t, lp) for t, lp in i.top]}
            for i in items
        ]
    }


def completion_logprobs(
    tokenizer: Any, items: list[TokenLogprob | None], offset0: int = 0
) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = offset0
    for item in items:
        if item is None:
            continue
        text = _token_text(tokenizer, item.token)
        tokens.append(text)
        token_lps.append(item.logprob)
        tops.append({_token_text(tokenizer, t): lp for t, lp in item.top} if item.top else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _pool(request: Request) -> Any:
    return request.app.state.pool


def media_policy(request: Request, model: str) -> MediaPolicy:
    """The request's media policy: images kept for a vision model, within the server's limits."""
    return MediaPolicy(model, _pool(request).accepts_images(model), ImageLimits.of(request.app.state.settings))


async def with_llm(request: Request, model: str, handler: Callable[..., Awaitable[Any]]) -> Any:
    """Lease the model's engine for the handler; a stream keeps the lease until it ends. The
    handler is cancelled when the client disconnects before it returns."""
    pool = _pool(request)

    async def leased() -> Any:
        engine, resolved = await pool.acquire(model, "llm")
        try:
            response = await handler(engine, resolved)
        except BaseException:
            pool.release(engine)
            raise
        if isinstance(response, EventStream):
            response.on_close.append(lambda: pool.release(engine))
        else:
            pool.release(engine)
        return response

    return await unless_disconnected(request, leased())


def default_max_tokens(request: Request, defaults: GenerationDefaults) -> int:
    return defaults.max_tokens or request.app.state.settings.default_max_tokens


def _usage(results: list[Collected]) -> dict[str, Any]:
    first = results[0]
    return usage_dict(
        first.prompt_tokens, sum(r.completion_tokens for r in results), first.cached_tokens, first.cache
    )


def _completion_prompts(tokenizer: Any, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [list(tokenizer.encode(prompt))]
    if not prompt:
        raise InvalidRequestError("prompt must not be empty.", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [list(tokenizer.encode(p)) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt]
    raise InvalidRequestError("prompt must be a string, a list of strings, or token ids.", param="prompt")


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    return await with_llm(request, body.model, lambda e, r: _completions(body, request, e, r))


async def _completions(body: CompletionRequest, request: Request, engine: LLMEngine, resolved: Resolved):
    defaults = resolved.defaults
    tokenizer = engine.tokenizer
    if isinstance(body.prompt, str) or any(isinstance(p, str) for p in body.prompt or ()):
        # tokenizing a long text would stall every stream on the event loop
        prompts = await asyncio.to_thread(_completion_prompts, tokenizer, body.prompt)
    else:
        # Token ids need no thread: under decode load each hop waits for the GIL the engine
        # holds, up to Python's switch interval, twice (docs/design/serving-layer.md).
        prompts = _completion_prompts(tokenizer, body.prompt)
    vocab = engine.model_vocab_size
    for p in prompts:
        if not p:
            raise InvalidRequestError("prompt must not be empty.", param="prompt")
        if any(not 0 <= t < vocab for t in p):
            raise InvalidRequestError(f"prompt has token ids outside the vocabulary (0..{vocab - 1}).", param="prompt")
    if body.max_tokens == 0 and not body.echo:
        raise InvalidRequestError("max_tokens 0 is only meaningful with echo.", param="max_tokens")
    if body.stream and body.echo and body.logprobs is not None:
        raise InvalidRequestError("echo with logprobs is not supported when streaming.", param="echo")
    sampling = sampling_from(body, vocab, defaults)
    fmt = completion_format(body.json_schema, body.regex, body.grammar)
    constraint = (await build_constraint(engine, fmt=fmt))[0] if fmt is not None else None
    requests: list[GenerationRequest] = []
    for p in prompts:
        budget = completion_budget(
            engine, len(p), body.max_tokens, default_max_tokens(request, defaults),
            window_cap=defaults.context_length, cap=defaults.max_tokens_cap, allow_zero=body.echo,
        )
        base = GenerationRequest(
            request_id=new_request_id("cmpl"),
            prompt_tokens=p,
            max_tokens=budget,
            sampling=sampling,
            stop=body.stop_list(),
            logprobs=body.logprobs,
            prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None,
            constraint=constraint,
        )
        requests += fan_out(base, body.n)
    rid = requests[0].request_id.rsplit("-", 1)[0] if body.n > 1 else requests[0].request_id
    bind(request_id=rid)
    created = int(time.time())
    prompt_texts = [tokenizer.decode(p) for p in prompts for _ in range(body.n)] if body.echo else []
    engine.reserve(requests)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStream(
            _completion_stream(engine, requests, rid, body.model, created, include_usage,
                               prompt_texts if body.echo else None, request.app.state.settings.keepalive_interval),
            on_close=lambda: engine.release(requests),
        )
    try:
        results = await collect(engine, requests)
    finally:
        engine.release(requests)
    choices = []
    for i, r in enumerate(results):
        text = (prompt_texts[i] + r.text) if body.echo else r.text
        lp = None
        if body.logprobs is not None:
            items: list[TokenLogprob | None] = []
            if body.echo and r.prompt_logprobs is not None:
                first = requests[i].prompt_tokens[0]
                # The first prompt token has no probability: OpenAI reports null for it.
                items = [TokenLogprob(first, None, [])] + list(r.prompt_logprobs[1:])  # type: ignore[arg-type]
            items += r.logprobs
            lp = completion_logprobs(tokenizer, items)
        choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": r.finish_reason or "length"})
    prompt_total = sum(len(p) for p in prompts)
    return JSONResponse(
        {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": body.model,
            "system_fingerprint": None,
            "choices": choices,
            "usage": usage_dict(
                prompt_total,
                sum(r.completion_tokens for r in results),
                sum(r.cached_tokens for r in results[:: body.n]),
                results[0].cache if len(prompts) == 1 else None,  # one prompt's restore (usage's `omlx`)
            ),
        }
    )


async def _completion_stream(
    engine: LLMEngine,
    requests: list[GenerationRequest],
    rid: str,
    model: str,
    created: int,
    include_usage: bool,
    echo_texts: list[str] | None,
    interval: float,
) -> AsyncIterator[str]:
    def chunk(choices: list[dict[str, Any]], usage: Any = None, with_usage: bool = False) -> str:
        payload = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
        if with_usage:
            payload["usage"] = usage
        return sse_data(payload)

    if echo_texts:
        for i, text in enumerate(echo_texts):
            yield chunk([{"index": i, "text": text, "logprobs": None, "finish_reason": None}], None, include_usage)
    finals: list[Collected] = [Collected() for _ in requests]
    want_logprobs = requests[0].logprobs is not None
    async for item in with_keepalive(merged(engine, requests), interval):
        if item is KEEPALIVE:
            yield ": keep-alive\n\n"
            continue
        i, ev = item  # type: ignore[misc]
        if ev.finish_reason == "error":
            kind = ev.error_type or "server_error"
            yield sse_data({"error": {"message": ev.error or "generation failed", "type": kind, "param": None, "code": None}})
            return
        if ev.text or (want_logprobs and ev.logprobs):
            lp = completion_logprobs(engine.tokenizer, list(ev.logprobs)) if want_logprobs else None
            yield chunk([{"index": i, "text": ev.text, "logprobs": lp, "finish_reason": None}], None, include_usage)
        if ev.finish_reason is not None:
            finals[i].add(ev)
            yield chunk([{"index": i, "text": "", "logprobs": None, "finish_reason": ev.finish_reason}], None, include_usage)
    if include_usage:
        first_of_each = finals
        usage = usage_dict(
            sum(len(r.prompt_tokens) for r in requests),
            sum(f.completion_tokens for f in first_of_each),
            sum(f.cached_tokens for f in first_of_each),
            finals[0].cache if all(r.prompt_tokens is requests[0].prompt_tokens for r in requests) else None,
        )
        yield chunk([], usage, True)
    yield "data: [DONE]\n\n"


def model_card(info: Any, pool: Any) -> dict[str, Any]:
    entry = pool.entries.get(info.id)
    engine = entry.engine if entry else None
    context = getattr(engine, "context_length", None) or info.context_length
    cap = pool.model_settings.get(info.id).context_length
    if cap and context:
        context = min(context, cap)
    return {
        "id": info.id,
        "object": "model",
        "created": int(info.path.stat().st_mtime),
        "owned_by": "omlx",
        "type": pool.model_settings.get(info.id).type or info.type,
        "context_length": context,
        "max_model_len": context,
        "vision": info.vision,  # accepts images (a vision-language model)
        "input_modalities": ["text", "image"] if info.vision else ["text"],
        "state": pool.state_of(info.id),
    }


@router.get("/v1/models")
async def list_models(request: Request):
    pool = _pool(request)
    pool.refresh()
    return {"object": "list", "data": [model_card(info, pool) for _, info in sorted(pool.models().items())]}


@router.get("/v1/models/status")
async def models_status(request: Request):
    return {"object": "list", "data": _pool(request).status()}


@router.post("/v1/models/{model_id:path}/load")
async def load_model(model_id: str, request: Request):
    pool = _pool(request)
    await pool.load(model_id)
    return {"id": pool.resolve(model_id).info.id, "state": pool.state_of(pool.resolve(model_id).info.id)}


@router.post("/v1/models/{model_id:path}/unload")
async def unload_model(model_id: str, request: Request):
    pool = _pool(request)
    info = pool.resolve(model_id).info
    if pool.state_of(info.id) == "serving":  # no entry held here: the unload's collection frees it
        raise InvalidRequestError(f"Model '{info.id}' is serving requests; try again when they finish.", param="model")
    return {"id": info.id, "unloaded": pool.unload(info.id), "state": pool.state_of(info.id)}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    pool = _pool(request)
    return model_card(pool.resolve(model_id).info, pool)
