"""`POST /v1/embeddings` (OpenAI) and `POST /v1/rerank` (Cohere/Jina shape).

Embeddings run on an embedding model's engine. Reranking runs either on a cross-encoder
(a `*ForSequenceClassification` model) or on any chat model, which judges each document
with a yes/no question on its own engine thread.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any, Literal

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from omlx.engine.request import new_request_id
from omlx.errors import InvalidRequestError
from omlx.models.causal_reranker import (
    answer_token_ids,
    is_trained_reranker,
    micro_batches,
    prompt_ids,
    score_prompts,
)
from omlx.models.encoder_loader import Encoded, LoadedEncoder

router = APIRouter()
MAX_INPUTS = 2048  # OpenAI's limit on inputs per embeddings request


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())
    model: str
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate: bool = False  # extension: cut inputs longer than the model's maximum
    truncate_prompt_tokens: int | None = None  # extension (vLLM): cut to N tokens, -1 = the maximum


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())
    model: str
    query: str
    documents: list[Any]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = False
    instruction: str | None = None  # chat-model reranking: the task the judge is given


# ----- embeddings ---------------------------------------------------------------------
def parse_input(value: Any) -> tuple[list[str] | None, list[list[int]] | None]:
    """OpenAI's four input shapes → (texts, None) or (None, token id lists)."""
    bad = InvalidRequestError(
        "input must be a string, a list of strings, a list of token ids or a list of lists of token ids.",
        param="input",
    )
    if isinstance(value, str):
        value = [value]
    elif not isinstance(value, list):
        raise bad
    if not value:
        raise InvalidRequestError("input must not be empty.", param="input")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        value = [value]
    if all(isinstance(v, str) for v in value):
        texts: list[str] = value
        for i, t in enumerate(texts):
            if not t:
                raise InvalidRequestError(f"input[{i}] is an empty string.", param="input")
        return _capped(texts), None
    if all(isinstance(v, list) for v in value):
        for i, ids in enumerate(value):
            if not ids:
                raise InvalidRequestError(
                    f"input[{i}] is an empty list of token ids.", param="input"
                )
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise bad
        return None, _capped(value)
    raise bad


def _capped(items: list) -> list:
    if len(items) > MAX_INPUTS:
        raise InvalidRequestError(
            f"input has {len(items)} items; at most {MAX_INPUTS} are allowed.", param="input"
        )
    return items


def truncate_limit(body: EmbeddingRequest, max_length: int) -> int | None:
    """The length inputs are cut to, or None when the request asks for no truncation."""
    k = body.truncate_prompt_tokens
    if k is not None:
        if k == -1:
            return max_length
        if k < 1:
            raise InvalidRequestError(
                "truncate_prompt_tokens must be a positive number of tokens, or -1 for the model's maximum.",
                param="truncate_prompt_tokens",
            )
        return min(k, max_length)
    return max_length if body.truncate else None


def cut_text(enc: Encoded, special: list[int], k: int) -> Encoded:
    """Keep the special tokens at both ends ([CLS] … [SEP]) and cut the text between."""
    lead = 0
    while lead < len(special) and special[lead]:
        lead += 1
    trail = 0
    while trail < len(special) - lead and special[len(special) - 1 - trail]:
        trail += 1
    keep = k - lead - trail
    if keep < 1:
        idx = list(range(k))
    else:
        idx = list(range(lead + keep)) + list(range(len(enc.ids) - trail, len(enc.ids)))
    types = [enc.type_ids[i] for i in idx] if enc.type_ids else None
    return Encoded([enc.ids[i] for i in idx], types)


def prepare_inputs(loaded: LoadedEncoder, body: EmbeddingRequest) -> list[Encoded]:
    """Tokenize (no MLX: runs off the event loop) and apply the length rules."""
    texts, id_lists = parse_input(body.input)
    limit = truncate_limit(body, loaded.max_length)
    out: list[Encoded] = []
    if texts is not None:
        for enc, special in loaded.encode_with_specials(texts):
            out.append(
                cut_text(enc, special, limit) if limit is not None and len(enc.ids) > limit else enc
            )
    else:
        for i, ids in enumerate(id_lists or []):
            if any(not 0 <= t < loaded.vocab_size for t in ids):
                raise InvalidRequestError(
                    f"input[{i}] has token ids outside the vocabulary (0..{loaded.vocab_size - 1}).",
                    param="input",
                )
            out.append(Encoded(ids[:limit] if limit is not None else list(ids)))
    for i, enc in enumerate(out):
        if len(enc.ids) > loaded.max_length:
            raise InvalidRequestError(
                f"input[{i}] has {len(enc.ids)} tokens, more than this model's maximum of "
                f'{loaded.max_length}. Shorten it, or ask for truncation with "truncate": true.',
                param="input",
                code="context_length_exceeded",
            )
    return out


def _encode_row(row: np.ndarray, fmt: str) -> Any:
    if fmt == "base64":
        return base64.b64encode(row.astype("<f4").tobytes()).decode("ascii")
    return row.tolist()


def _pool(request: Request) -> Any:
    return request.app.state.pool


def _require_type(pool: Any, name: str, allowed: tuple[str, ...], endpoint: str) -> str:
    resolved = pool.resolve(name)
    if resolved.type not in allowed:
        need = " or ".join(
            {"llm": "chat", "reranker": "reranker", "embedding": "embedding"}[a] for a in allowed
        )
        raise InvalidRequestError(
            f"Model '{name}' is a{'n' if resolved.type[0] in 'aeiou' else ''} {resolved.type} model; "
            f"{endpoint} needs a{'n' if need[0] in 'aeiou' else ''} {need} model.",
            param="model",
            code="wrong_model_type",
        )
    return resolved.type


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    pool = _pool(request)
    _require_type(pool, body.model, ("embedding",), "/v1/embeddings")
    parse_input(body.input)  # shape errors before any model loads
    async with pool.lease(body.model, "embedding") as (engine, _):
        loaded: LoadedEncoder = engine.loaded
        dims = body.dimensions
        if dims is not None and not 1 <= dims <= loaded.dimensions:
            raise InvalidRequestError(
                f"dimensions must be between 1 and this model's {loaded.dimensions}; got {dims}.",
                param="dimensions",
            )
        inputs = await asyncio.to_thread(prepare_inputs, loaded, body)
        rows = await engine.run(inputs)
    if dims is not None and dims < rows.shape[1]:
        rows = rows[:, :dims]
        if loaded.normalize:
            rows = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-12)
    tokens = sum(len(e.ids) for e in inputs)
    # JSONResponse directly: FastAPI's encoder would walk every float of every vector.
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "object": "embedding",
                    "index": i,
                    "embedding": _encode_row(row, body.encoding_format),
                }
                for i, row in enumerate(rows)
            ],
            "model": body.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )


# ----- rerank -------------------------------------------------------------------------
def document_texts(documents: list[Any]) -> list[str]:
    if not documents:
        raise InvalidRequestError("documents must not be empty.", param="documents")
    texts = []
    for i, d in enumerate(documents):
        if isinstance(d, dict):
            d = d.get("text")
        if not isinstance(d, str):
            raise InvalidRequestError(
                f'documents[{i}] must be a string or an object with a "text" string.',
                param="documents",
            )
        texts.append(d)
    return texts


async def _cross_encoder_scores(
    pool: Any, body: RerankRequest, docs: list[str]
) -> tuple[list[float], int]:
    async with pool.lease(body.model, "reranker") as (engine, _):
        loaded: LoadedEncoder = engine.loaded
        inputs = await asyncio.to_thread(loaded.encode_pairs, body.query, docs)
        scores = await engine.run(inputs)
    return [float(s) for s in scores], sum(len(e.ids) for e in inputs)


async def _chat_model_scores(
    pool: Any, body: RerankRequest, docs: list[str]
) -> tuple[list[float], int]:
    async with pool.lease(body.model, "llm") as (engine, _):
        tokenizer = engine.tokenizer

        def render() -> tuple[list[list[int]], list[int], list[int]]:
            yes, no = answer_token_ids(tokenizer)
            fmt = is_trained_reranker(engine.model_id)
            prompts = [
                prompt_ids(tokenizer, body.query, d, body.instruction, reranker_format=fmt)
                for d in docs
            ]
            return prompts, yes, no

        try:
            prompts, yes, no = await asyncio.to_thread(render)
        except ValueError as exc:
            raise InvalidRequestError(
                f"Model '{body.model}' cannot rerank: {exc}.", param="model"
            ) from None
        for i, p in enumerate(prompts):
            if len(p) > engine.context_length:
                raise InvalidRequestError(
                    f"documents[{i}] makes a {len(p)}-token judging prompt, more than this model's context "
                    f"window of {engine.context_length}. Shorten the document or the query.",
                    param="documents",
                    code="context_length_exceeded",
                )
        scores = [0.0] * len(prompts)
        vocab = engine.model_vocab_size or 1
        for batch in micro_batches([len(p) for p in prompts], vocab):
            chunk = [prompts[i] for i in batch]
            # one engine.call per micro-batch: generation streams keep flowing in between
            got = await engine.call(lambda chunk=chunk: score_prompts(engine.model, chunk, yes, no))
            for i, s in zip(batch, got, strict=True):
                scores[i] = float(s)
    return scores, sum(len(p) for p in prompts)


@router.post("/v1/rerank")
@router.post("/v2/rerank")
@router.post("/rerank")
async def rerank(body: RerankRequest, request: Request):
    pool = _pool(request)
    if not body.query.strip():
        raise InvalidRequestError("query must not be empty.", param="query")
    docs = document_texts(body.documents)
    kind = _require_type(pool, body.model, ("reranker", "llm"), "/v1/rerank")
    if kind == "reranker":
        scores, tokens = await _cross_encoder_scores(pool, body, docs)
    else:
        scores, tokens = await _chat_model_scores(pool, body, docs)
    order = sorted(range(len(docs)), key=lambda i: (-scores[i], i))
    if body.top_n is not None:
        order = order[: body.top_n]
    results = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if body.return_documents:
            item["document"] = {"text": docs[i]}
        results.append(item)
    return {
        "id": new_request_id("rerank"),
        "model": body.model,
        "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
