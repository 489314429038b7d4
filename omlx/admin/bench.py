"""A throughput benchmark run inside the server, through the engine pool.

One run: `concurrency` requests of `prompt_tokens` each, generating `max_tokens` each (end
of sequence suppressed so every request generates the full length), twice — first with
prompts no cache has seen (cold), then the very same prompts again (warm), which the
prefix cache restores. Reports time to first token, decode speed, total throughput and
cached tokens per phase.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import statistics
import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import Field, SkipValidation

from omlx.admin.bodies import PassThrough, as_sent, required
from omlx.engine.request import GenerationRequest, SamplingParams, new_request_id
from omlx.errors import ConflictError, InvalidRequestError, OMLXError
from omlx.server.auth import require_admin

log = logging.getLogger("omlx.admin.bench")

FILLER = (
    "Local inference servers keep the key and value tensors of a prompt so that the next "
    "request sharing that prefix starts decoding at once. Coding agents resend long system "
    "prompts, tool descriptions and file contents every turn; recomputing them dominates the "
    "time to first token on small machines. "
)
LIMITS = {"prompt_tokens": (1, 131072), "max_tokens": (1, 8192), "concurrency": (1, 64)}
DEFAULTS = {"prompt_tokens": 512, "max_tokens": 128, "concurrency": 1}


def _count(name: str, what: str) -> Any:
    lo, hi = LIMITS[name]
    return Field(DEFAULTS[name], ge=lo, le=hi, description=what)


class BenchBody(PassThrough):
    """A benchmark run (checked by `BenchRunner.start`)."""

    model_config = required("model")
    model: SkipValidation[str] = Field(None, description="The chat model to benchmark")
    prompt_tokens: SkipValidation[int] = _count("prompt_tokens", "Tokens per prompt")
    max_tokens: SkipValidation[int] = _count("max_tokens", "Tokens generated per request")
    concurrency: SkipValidation[int] = _count("concurrency", "Requests run at once")


def build_prompts(tokenizer: Any, run_id: str, count: int, length: int) -> list[list[int]]:
    """`count` prompts of exactly `length` tokens, each starting differently (no shared prefix)."""
    base = list(tokenizer.encode(FILLER * 4))
    prompts = []
    for i in range(count):
        head = list(tokenizer.encode(f"Benchmark {run_id} request {i}. "))
        body = head + base
        while len(body) < length:
            body += base
        prompts.append(body[:length])
    return prompts


def _summary(results: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    ttfts = [r["ttft_s"] for r in results]
    decode = [r["decode_tps"] for r in results if r["decode_tps"]]
    completion = sum(r["completion_tokens"] for r in results)
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    return {
        "requests": len(results),
        "wall_s": wall,
        "ttft_avg_s": statistics.fmean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_max_s": max(ttfts),
        "decode_tps_avg": statistics.fmean(decode) if decode else None,
        "throughput_tps": completion / wall if wall > 0 else None,
        # Only meaningful when most of the prompt was computed (the cold phase).
        "prefill_tps": (prompt - cached) / max(ttfts) if max(ttfts) > 0 and prompt - cached > prompt / 2 else None,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
    }


class BenchRunner:
    def __init__(self, pool: Any):
        self.pool = pool
        self.task: asyncio.Task | None = None
        self.state: dict[str, Any] = {"state": "idle"}

    @property
    def running(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.running:
            raise ConflictError("A benchmark is already running; wait for it or cancel it.")
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequestError("Name the model to benchmark.", param="model")
        resolved = self.pool.resolve(model)
        if resolved.type != "llm":
            raise InvalidRequestError(f"Model '{model}' is a {resolved.type} model; benchmarks need a chat model.", param="model")
        params: dict[str, Any] = {"model": model}
        for name, (lo, hi) in LIMITS.items():
            value = body.get(name, DEFAULTS[name])
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise InvalidRequestError(f"{name} must be an integer from {lo} to {hi}.", param=name)
            params[name] = value
        self.state = {
            "state": "running", "phase": "loading", "params": params, "started": time.time(),
            "finished": None, "error": None, "done": 0, "total": 2 * params["concurrency"],
            "tokens": 0, "phases": {},
        }
        self.task = asyncio.get_running_loop().create_task(self._run(params))
        return self.status()

    def cancel(self) -> dict[str, Any]:
        if not self.running:
            raise ConflictError("No benchmark is running.")
        assert self.task is not None
        self.task.cancel()
        return self.status()

    def status(self) -> dict[str, Any]:
        return dict(self.state)

    def shutdown(self) -> None:
        if self.running:
            assert self.task is not None
            self.task.cancel()

    async def _run(self, params: dict[str, Any]) -> None:
        st = self.state
        try:
            engine, _ = await self.pool.acquire(params["model"], "llm")
            try:
                await self._phases(engine, params)
            finally:
                self.pool.release(engine)
            st["state"] = "completed"
        except asyncio.CancelledError:
            st["state"] = "cancelled"
        except OMLXError as exc:
            st["state"], st["error"] = "failed", exc.message
        except Exception as exc:  # reported in the status; the server goes on
            log.exception("benchmark failed")
            st["state"], st["error"] = "failed", f"{type(exc).__name__}: {exc}"
        finally:
            st["finished"] = time.time()
            st["phase"] = None
            log.info("benchmark of %s %s", params["model"], st["state"])

    async def _phases(self, engine: Any, params: dict[str, Any]) -> None:
        n, length, max_tokens = params["concurrency"], params["prompt_tokens"], params["max_tokens"]
        if length + max_tokens > engine.context_length:
            raise InvalidRequestError(
                f"prompt_tokens + max_tokens = {length + max_tokens} exceeds the context window of "
                f"'{engine.model_id}' ({engine.context_length} tokens).",
                param="prompt_tokens",
            )
        prompts = await asyncio.to_thread(build_prompts, engine.tokenizer, secrets.token_hex(4), n, length)
        suppress_eos = {t: -1e9 for t in engine.eos_ids} or None
        log.info("benchmark %s: %d x (%d prompt + %d output) tokens, cold then warm",
                 engine.model_id, n, length, max_tokens)
        for phase in ("cold", "warm"):
            self.state["phase"] = phase
            requests = [
                GenerationRequest(
                    request_id=new_request_id(f"bench-{phase}"),
                    prompt_tokens=p,
                    max_tokens=max_tokens,
                    sampling=SamplingParams(temperature=0.0, logit_bias=suppress_eos),
                )
                for p in prompts
            ]
            tic = time.perf_counter()
            results = await asyncio.gather(*(self._one(engine, r) for r in requests))
            self.state["phases"][phase] = _summary(list(results), time.perf_counter() - tic)

    async def _one(self, engine: Any, req: GenerationRequest) -> dict[str, Any]:
        start = time.perf_counter()
        first = None
        out: dict[str, Any] = {}
        async for ev in engine.generate(req):
            if ev.token_ids and first is None:
                first = time.perf_counter()
            self.state["tokens"] += len(ev.token_ids)
            if ev.finish_reason is not None:
                if ev.finish_reason == "error":
                    raise OMLXError(ev.error or "generation failed")
                end = time.perf_counter()
                first = first or end
                out = {
                    "ttft_s": first - start,
                    "decode_tps": (ev.completion_tokens - 1) / (end - first)
                    if ev.completion_tokens > 1 and end > first else None,
                    "prompt_tokens": ev.prompt_tokens,
                    "cached_tokens": ev.cached_tokens,
                    "completion_tokens": ev.completion_tokens,
                }
        self.state["done"] += 1
        return out


router = APIRouter(prefix="/api", dependencies=[Depends(require_admin)])


@router.get("/bench")
async def bench_status(request: Request) -> dict[str, Any]:
    return request.app.state.bench.status()


@router.post("/bench")
async def bench_start(request: Request, body: BenchBody) -> dict[str, Any]:
    return request.app.state.bench.start(as_sent(body))


@router.post("/bench/cancel")
async def bench_cancel(request: Request) -> dict[str, Any]:
    return request.app.state.bench.cancel()
