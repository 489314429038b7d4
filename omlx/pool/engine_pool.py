"""The engine pool: discovers models and loads each one exactly once, on first use.

Concurrent first requests for one model share a single load; a failed load is
reported to every waiter and retried by the next request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omlx.engine.llm_engine import LLMEngine, PrefixCacheHooks
from omlx.errors import InvalidRequestError, ModelNotFoundError
from omlx.models.discovery import Discovery, ModelInfo, discover_models
from omlx.models.loader import LoadedLLM, load_llm
from omlx.settings import Settings

log = logging.getLogger("omlx.pool")


class EnginePool:
    def __init__(
        self,
        settings: Settings,
        prefix_cache_factory: Callable[[LoadedLLM], PrefixCacheHooks] | None = None,
    ):
        self.settings = settings
        self.prefix_cache_factory = prefix_cache_factory
        self.discovery: Discovery = Discovery({}, [])
        self.engines: dict[str, LLMEngine] = {}
        self.last_used: dict[str, float] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.refresh()

    @property
    def model_dir(self) -> Path:
        return self.settings.model_dir

    def refresh(self) -> Discovery:
        self.discovery = discover_models(self.model_dir)
        return self.discovery

    def models(self) -> dict[str, ModelInfo]:
        return self.discovery.models

    def resolve(self, model: str) -> ModelInfo:
        info = self.discovery.models.get(model)
        if info is None:
            self.refresh()
            info = self.discovery.models.get(model)
        if info is None:
            raise ModelNotFoundError(model, sorted(self.discovery.models))
        return info

    async def acquire(self, model: str) -> LLMEngine:
        """The loaded engine for `model`, loading it on first use."""
        info = self.resolve(model)
        if info.type != "llm":
            raise InvalidRequestError(
                f"Model '{model}' is a {info.type} model; it cannot generate text.", param="model"
            )
        engine = self.engines.get(info.id)
        if engine is None:
            lock = self._locks.setdefault(info.id, asyncio.Lock())
            async with lock:
                engine = self.engines.get(info.id)
                if engine is None:
                    engine = self._start_engine(info)
                    try:
                        await engine.wait_ready()
                    except BaseException:
                        engine.shutdown()
                        raise
                    self.engines[info.id] = engine
        await engine.wait_ready()
        self.last_used[info.id] = time.time()
        return engine

    def _start_engine(self, info: ModelInfo) -> LLMEngine:
        s = self.settings
        log.info("loading model %s from %s", info.id, info.path)
        return LLMEngine(
            info.id,
            lambda: load_llm(info, s.compute_dtype),
            max_concurrent=s.max_concurrent_requests,
            max_waiting=s.max_waiting_requests,
            prefill_step_size=s.prefill_step_size,
            prefix_cache_factory=self.prefix_cache_factory,
        )

    def status(self) -> list[dict[str, Any]]:
        out = []
        for model_id, info in sorted(self.discovery.models.items()):
            engine = self.engines.get(model_id)
            out.append(
                {
                    "id": model_id,
                    "type": info.type,
                    "state": "loaded" if engine else "unloaded",
                    "active_requests": engine.active_count if engine else 0,
                    "waiting_requests": engine.waiting_count if engine else 0,
                    "last_used": self.last_used.get(model_id),
                }
            )
        return out

    def shutdown(self) -> None:
        for engine in self.engines.values():
            engine.shutdown()
        self.engines.clear()
