"""FastAPI app factory: wires settings, the cache, the engine pool, routes and error handlers."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from omlx import __version__
from omlx.admin import install_admin, shutdown_admin, start_admin
from omlx.admin.metrics import RequestMetrics
from omlx.api.responses_models import ResponseStore
from omlx.cache.prefix_cache import make_prefix_cache
from omlx.cache.setup import build_cache_store
from omlx.cache.sizes import parse_size
from omlx.cache.tiers.tiers import Tiers
from omlx.engine.config import EngineConfig
from omlx.engine.device_fault import DEVICE
from omlx.engine.embedding_engine import encoder_factories
from omlx.engine.llm_engine import LLMEngine
from omlx.errors import ConfigError
from omlx.mcp import mcp_manager
from omlx.models.discovery import ModelInfo
from omlx.models.loader import load_with_draft
from omlx.pool.engine_pool import EngineFactory, EnginePool
from omlx.pool.memory import memory_limit_total
from omlx.pool.memory_guard import MemoryGuard, parse_limit
from omlx.pool.model_settings import ModelSettings
from omlx.server.admin_routes import router as admin_router
from omlx.server.anthropic_routes import router as anthropic_router
from omlx.server.auth import require_admin, require_api_key
from omlx.server.body_limits import BodyLimits
from omlx.server.cache_explain import router as cache_explain_router
from omlx.server.embedding_routes import router as embedding_router
from omlx.server.errors import install_error_handlers
from omlx.server.mcp_routes import router as mcp_router
from omlx.server.openai_chat import router as openai_chat_router
from omlx.server.openai_routes import router as openai_router
from omlx.server.openapi import install_openapi
from omlx.server.prometheus import install_metrics
from omlx.server.responses_routes import router as responses_router
from omlx.server.startup import StartState, load_at_start
from omlx.server.turn_memory import TurnMemory
from omlx.settings import Settings

log = logging.getLogger("omlx.server")


def llm_factory(
    settings: Settings, store: Tiers | None, on_finished: Callable[[str, dict], None] | None = None
) -> EngineFactory:
    try:
        kv_memory = None if settings.max_kv_memory == "auto" else parse_size(settings.max_kv_memory, total=memory_limit_total())
    except ValueError as exc:
        raise ConfigError(f"Invalid value for max_kv_memory: {exc}") from None
    try:
        config = EngineConfig.resolve(prefill_step_size=settings.prefill_step_size)  # what each engine resolves
        stateful_block = config.stateful_block_size(settings.stateful_block_size)
    except ValueError as exc:
        raise ConfigError(f"Invalid value for stateful_block_size: {exc}") from None
    cache_factory = None
    if store is not None:
        cache_factory = partial(make_prefix_cache, store, captures_states=True, stateful_block_size=stateful_block)

    def make(info: ModelInfo, ms: ModelSettings, draft: ModelInfo | None = None) -> LLMEngine:
        return LLMEngine(
            info.id,
            lambda: load_with_draft(info, draft, settings.compute_dtype, kept_root=settings.home / "converted"),
            max_concurrent=settings.max_concurrent_requests,
            max_waiting=settings.max_waiting_requests,
            prefill_step_size=settings.prefill_step_size,
            prefix_cache_factory=cache_factory,
            on_finished=on_finished,
            graph_warmup_tokens=settings.graph_warmup_tokens,
            max_kv_memory=kv_memory,
            speculation=settings.speculation if ms.speculation is None else ms.speculation,
            draft_max=settings.draft_max,
            batch_speculation={"on": True, "off": False}.get(settings.batch_speculation),
        )

    return make


def engine_factories(
    settings: Settings, store: Tiers | None, on_finished: Callable[[str, dict], None] | None = None
) -> dict[str, EngineFactory]:
    """One factory per model type; the pool routes each model to its engine kind."""
    return {"llm": llm_factory(settings, store, on_finished), **encoder_factories(settings)}


def create_app(settings: Settings) -> FastAPI:
    store = build_cache_store(settings)
    try:
        max_memory = parse_size(settings.max_model_memory, total=memory_limit_total())
    except ValueError as exc:
        raise ConfigError(f"Invalid value for max_model_memory: {exc}") from None
    try:
        parse_limit(settings.max_process_memory)
    except ValueError as exc:
        raise ConfigError(f"Invalid value for max_process_memory: {exc}") from None
    metrics = RequestMetrics()
    pool = EnginePool(settings, engine_factories(settings, store, metrics.record), max_memory=max_memory)
    pool.memory_guard = MemoryGuard(pool, store, lambda: settings.max_process_memory)
    mcp = mcp_manager(settings)  # a bad config file stops the start; its servers connect later

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        pool.start_reaper()
        pool.memory_guard.start()
        start_admin(app)
        # set by the runner: the default model it provisioned now, and whether uvicorn listens
        pool.refresh()  # that model came after the pool's first scan
        app.state.start = StartState(pool.models_to_warm(getattr(app.state, "provisioned", None)))
        starting = asyncio.create_task(load_at_start(app, getattr(app.state, "listening", lambda: True)))
        if mcp is not None:
            mcp.start()  # each server in the background: none holds up the start
        yield
        starting.cancel()
        if mcp is not None:
            await mcp.close()
        pool.memory_guard.stop()
        shutdown_admin(app)
        pool.shutdown()
        if store is not None:
            store.close()

    app = FastAPI(
        title="oMLX", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.settings = settings
    app.state.pool = pool
    app.state.cache = store
    app.state.responses = ResponseStore()
    app.state.turn_memory = TurnMemory()  # answers as generated, for the next turn's prompt
    app.state.started = time.time()
    app.state.metrics = metrics
    app.state.mcp = mcp
    install_error_handlers(app)
    app.add_middleware(BodyLimits)

    @app.get("/health", response_model=None)
    async def health(request: Request) -> dict[str, str] | JSONResponse:
        if DEVICE.lost is not None:  # the process is shutting down to be restarted
            return JSONResponse({"status": "unhealthy", "reason": f"the GPU failed: {DEVICE.lost}"}, status_code=503)
        start = getattr(request.app.state, "start", None)
        if start is not None and not start.ready:  # the warm-start models are loading
            return JSONResponse({"status": "loading", "models": start.pending}, status_code=503,
                                headers={"Retry-After": "1"})
        return {"status": "ok"}

    @app.head("/")
    @app.get("/")
    async def root() -> dict[str, str]:
        return {"name": "oMLX", "version": __version__}

    @app.get("/api/status", dependencies=[Depends(require_admin)])
    async def status(request: Request) -> dict[str, Any]:
        models = request.app.state.pool.status()
        return {
            "version": __version__,
            "uptime_s": time.time() - request.app.state.started,
            "active_requests": sum(m["active_requests"] for m in models),
            "waiting_requests": sum(m["waiting_requests"] for m in models),
            "device_lost": DEVICE.lost,  # the GPU's error, once it failed (the server is leaving)
            "models": models,
        }

    app.include_router(admin_router, dependencies=[Depends(require_admin)])
    app.include_router(cache_explain_router, dependencies=[Depends(require_admin)])
    app.include_router(openai_chat_router, dependencies=[Depends(require_api_key)])
    app.include_router(openai_router, dependencies=[Depends(require_api_key)])
    app.include_router(embedding_router, dependencies=[Depends(require_api_key)])
    app.include_router(anthropic_router, dependencies=[Depends(require_api_key)])
    app.include_router(responses_router, dependencies=[Depends(require_api_key)])
    app.include_router(mcp_router, dependencies=[Depends(require_api_key)])
    install_admin(app)
    install_openapi(app)  # /openapi.json, behind the API key like /v1
    install_metrics(app)  # /metrics, behind the API key unless --metrics-public
    return app
