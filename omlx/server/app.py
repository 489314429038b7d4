"""FastAPI app factory: wires settings, the engine pool, routes and error handlers."""

from __future__ import annotations

import logging
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request

from omlx import __version__
from omlx.cache.prefix_cache import make_prefix_cache
from omlx.cache.setup import build_cache_store
from omlx.pool.engine_pool import EnginePool
from omlx.server.auth import require_api_key
from omlx.server.errors import install_error_handlers
from omlx.server.openai_routes import router as openai_router
from omlx.settings import Settings

log = logging.getLogger("omlx.server")


def create_app(settings: Settings) -> FastAPI:
    store = build_cache_store(settings)
    factory = None if store is None else (lambda loaded: make_prefix_cache(store, loaded))
    pool = EnginePool(settings, prefix_cache_factory=factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if settings.model:
            log.info("preloading model %s", settings.model)
            await pool.acquire(settings.model)
        yield
        pool.shutdown()
        if store is not None:
            store.close()

    app = FastAPI(title="oMLX", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.settings = settings
    app.state.pool = pool
    app.state.cache = store
    app.state.started = time.time()
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.head("/")
    @app.get("/")
    async def root() -> dict[str, str]:
        return {"name": "oMLX", "version": __version__}

    @app.get("/api/status", dependencies=[Depends(require_api_key)])
    async def status(request: Request) -> dict[str, Any]:
        p: EnginePool = request.app.state.pool
        models = p.status()
        return {
            "version": __version__,
            "uptime_s": time.time() - request.app.state.started,
            "active_requests": sum(m["active_requests"] for m in models),
            "waiting_requests": sum(m["waiting_requests"] for m in models),
            "models": models,
        }

    @app.get("/api/cache/stats", dependencies=[Depends(require_api_key)])
    async def cache_stats(request: Request) -> dict[str, Any]:
        c = request.app.state.cache
        return {"enabled": False} if c is None else {"enabled": True, **c.stats()}

    @app.post("/api/cache/clear", dependencies=[Depends(require_api_key)])
    async def cache_clear(request: Request) -> dict[str, Any]:
        c = request.app.state.cache
        if c is not None:
            c.clear()
        return {"cleared": c is not None}

    app.include_router(openai_router, dependencies=[Depends(require_api_key)])
    return app
