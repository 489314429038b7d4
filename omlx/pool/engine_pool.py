"""The engine pool: discovery, load on first use, LRU eviction under a memory limit, pin, TTL.

Every engine kind (chat LLM, embedding, reranker) lives here behind the same small
interface: `wait_ready()`, `shutdown()`, `busy`, `memory_bytes`, `leases`. Routes
take a lease (`async with pool.lease(name)`) for as long as they use an engine, so
a model serving requests is never evicted or expired.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from omlx.cache.sizes import format_size
from omlx.engine.device_fault import DEVICE
from omlx.errors import (
    InsufficientMemoryError,
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
    OMLXError,
)
from omlx.models.discovery import Discovery, ModelInfo, discover_models
from omlx.models.vision import check_servable
from omlx.pool.memory import estimate_model_bytes
from omlx.pool.memory_guard import MemoryGuard
from omlx.pool.model_settings import GenerationDefaults, ModelSettings, ModelSettingsStore
from omlx.pool.warm_start import FILE_NAME as WARM_FILE
from omlx.pool.warm_start import LoadedModels, models_to_warm
from omlx.server.log_setup import bind
from omlx.settings import Settings

log = logging.getLogger("omlx.pool")


class Engine(Protocol):
    model_id: str
    kind: str
    memory_bytes: int
    leases: int

    @property
    def busy(self) -> bool: ...

    async def wait_ready(self) -> None: ...

    def request_stop(self) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None: ...


# (model, its settings) or, for an LLM with a `draft_model` setting, (model, settings, draft model)
EngineFactory = Callable[..., Engine]


@dataclass
class Resolved:
    """A request's model name resolved to a model, its settings and an optional profile."""

    info: ModelInfo
    settings: ModelSettings
    profile: str | None

    @property
    def defaults(self) -> GenerationDefaults:
        return self.settings.effective(self.profile)

    @property
    def type(self) -> str:
        return self.settings.type or self.info.type


@dataclass
class Entry:
    engine: Engine
    estimate: int
    loaded_at: float
    last_used: float

    @property
    def memory(self) -> int:
        return self.engine.memory_bytes or self.estimate


def _load_failure(model_id: str, exc: Exception) -> OMLXError:
    """What a request for a model whose load failed is told: our own errors as they are, any
    other (a bad config, unreadable weights) as the model's unavailability, never a 500."""
    if isinstance(exc, OMLXError):
        return exc
    log.warning("model %s could not be loaded: %s: %s", model_id, type(exc).__name__, exc)
    return ModelLoadError(model_id, exc)


def freeze_heap(unfreeze: bool = False) -> None:
    """Collect, then exempt every object alive now from the collector's later passes.

    A loaded model, its tokenizer and the server's imports are hundreds of thousands of
    tracked objects, and a full pass over them stops every thread, streams included
    (docs/design/serving-layer.md); after a load they only die when their model is
    unloaded. So the heap is frozen after each load, and thawed first after an unload
    (`unfreeze`), so that what of the model only the collector can free (cycles; mlx-lm's
    Llama has none, other models may) is not kept for good. A cycle that is alive at a freeze
    and dies later (another model's request in flight) waits for the next unload's pass."""
    if unfreeze:
        gc.unfreeze()
    gc.collect()
    gc.freeze()


class EnginePool:
    def __init__(self, settings: Settings, factories: dict[str, EngineFactory], max_memory: int = 0):
        self.settings = settings
        self.factories = factories
        self.max_memory = max_memory  # 0 = no limit
        self.model_settings = ModelSettingsStore(settings.home / "model_settings.json")
        self.discovery: Discovery = Discovery({}, [])
        self.entries: dict[str, Entry] = {}
        self.loading: set[str] = set()
        self._model_locks: dict[str, asyncio.Lock] = {}
        self._load_lock = asyncio.Lock()  # one load at a time: memory is measured per load
        self._reaper: asyncio.Task | None = None
        self._collect_pending = False  # an unload's collection is due on the event loop
        self.loads: dict[str, list[float]] = {}  # model -> [loads, seconds loading], for /metrics
        self.unloads: dict[tuple[str, str], int] = {}  # (model, reason) -> count, for /metrics
        self.loaded_models = LoadedModels(settings.home / WARM_FILE)  # loaded again at the next start
        self.memory_guard: MemoryGuard | None = None  # --max-process-memory, set by the app
        self.refresh()

    # ----- discovery and names -----------------------------------------------------
    def refresh(self) -> Discovery:
        self.discovery = discover_models(self.settings.model_dir)
        return self.discovery

    def models(self) -> dict[str, ModelInfo]:
        return self.discovery.models

    def resolve(self, name: str) -> Resolved:
        """`id`, `alias`, `id:profile` or `alias:profile` → the model and its settings."""
        for attempt in range(2):
            found = self._resolve_once(name)
            if found is not None:
                return found
            if attempt == 0:
                self.refresh()
        raise ModelNotFoundError(name, sorted(self.discovery.models))

    def _resolve_once(self, name: str) -> Resolved | None:
        models = self.discovery.models
        candidates = [(name, None)]
        if ":" in name:
            base, profile = name.rsplit(":", 1)
            candidates.append((base, profile))
        for model_name, profile in candidates:
            model_id = model_name if model_name in models else self.model_settings.resolve_alias(
                model_name, set(models)
            )
            if model_id is None:
                continue
            ms = self.model_settings.get(model_id)
            if profile is not None and profile not in ms.profiles:
                continue
            return Resolved(models[model_id], ms, profile)
        return None

    # ----- leasing engines ---------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lease(self, name: str, kind: str | None = None) -> AsyncIterator[tuple[Any, Resolved]]:
        """The loaded engine for `name` (loading it if needed), held for the block's duration."""
        engine, resolved = await self.acquire(name, kind)
        try:
            yield engine, resolved
        finally:
            self.release(engine)

    def accepts_images(self, name: str) -> bool:
        """Whether `name` resolves to a vision-language model (False for unknown names: the lease says why)."""
        try:
            return self.resolve(name).info.vision
        except ModelNotFoundError:
            return False

    async def acquire(self, name: str, kind: str | None = None) -> tuple[Any, Resolved]:
        """Like `lease`, for callers that release later (streams): pair with `release()`."""
        resolved = self.resolve(name)
        if kind is not None and resolved.type != kind:
            raise InvalidRequestError(
                f"Model '{name}' is a {resolved.type} model, not a {kind} model.", param="model"
            )
        bind(model=resolved.info.id)  # the request's later log lines name its model
        if self.memory_guard is not None:
            await self.memory_guard.admit()  # over the process memory limit: wait, then 503
        entry = await self._ensure_loaded(resolved)
        entry.engine.leases += 1
        entry.last_used = time.time()
        return entry.engine, resolved

    def release(self, engine: Any) -> None:
        engine.leases = max(0, engine.leases - 1)
        entry = self.entries.get(engine.model_id)
        if entry is not None:
            entry.last_used = time.time()

    async def _ensure_loaded(self, resolved: Resolved) -> Entry:
        DEVICE.raise_if_lost()  # nothing can load or run any more: 503 rather than a load failure
        model_id = resolved.info.id
        entry = self.entries.get(model_id)
        if entry is not None:
            return entry
        if resolved.info.vision:  # a 400 naming the extra (or the architecture), never a text-only load
            await asyncio.to_thread(check_servable, resolved.info)  # its first call imports mlx-vlm
        lock = self._model_locks.setdefault(model_id, asyncio.Lock())
        async with lock:  # concurrent first requests share one load
            entry = self.entries.get(model_id)
            if entry is not None:
                return entry
            async with self._load_lock:
                return await self._load(resolved)

    async def _load(self, resolved: Resolved) -> Entry:
        info = resolved.info
        factory = self.factories.get(resolved.type)
        if factory is None:
            raise InvalidRequestError(
                f"Model '{info.id}' is a {resolved.type} model, which this server cannot serve yet.",
                param="model",
            )
        draft = self._draft_info(resolved)
        dtype = self._compute_dtype(resolved.type)
        estimate = estimate_model_bytes(info, dtype) + (estimate_model_bytes(draft, dtype) if draft is not None else 0)
        self._make_room(info.id, estimate)
        if self.memory_guard is not None:
            self.memory_guard.room_for(info.id, estimate)
        log.info("loading %s (%s, estimated %s)", info.id, resolved.type, format_size(estimate))
        self.loading.add(info.id)
        tic = time.perf_counter()
        try:
            engine = factory(info, resolved.settings) if draft is None else factory(info, resolved.settings, draft)
        except Exception as exc:
            self.loading.discard(info.id)
            raise _load_failure(info.id, exc) from exc
        try:
            await engine.wait_ready()
        except BaseException as exc:
            engine.shutdown()
            if isinstance(exc, Exception):
                raise _load_failure(info.id, exc) from exc
            raise
        finally:
            self.loading.discard(info.id)
        now = time.time()
        entry = Entry(engine, estimate, now, now)
        self.entries[info.id] = entry
        freeze_heap()
        seconds = time.perf_counter() - tic
        self.loaded_models.loaded(info.id)
        record = self.loads.setdefault(info.id, [0, 0.0])
        record[0] += 1
        record[1] += seconds
        log.info(
            "loaded %s in %.2fs: %s measured (estimate %s)",
            info.id, seconds, format_size(engine.memory_bytes), format_size(estimate),
        )
        return entry

    def _draft_info(self, resolved: Resolved) -> ModelInfo | None:
        """The model of `resolved`'s `draft_model` setting (None: it has none, or does not
        speculate); a 400 when that names no text model of the model directory."""
        name, on = resolved.settings.draft_model, resolved.settings.speculation
        if name is None or not (self.settings.speculation if on is None else on) or not self.settings.draft_max:
            return None  # no speculation for this model: nothing would draft
        draft = self.discovery.models.get(name)
        if resolved.type != "llm" or draft is None or draft.type != "llm" or draft.vision:
            raise InvalidRequestError(
                f"Model '{resolved.info.id}' has draft_model '{name}', which is not a text model in the model "
                "directory; change the setting (PUT /api/models/{id}/settings).",
                param="model",
            )
        return draft

    def _compute_dtype(self, kind: str) -> str:
        from omlx.models.loader import resolve_compute_dtype

        return resolve_compute_dtype(self.settings.compute_dtype) if kind == "llm" else "native"

    def _make_room(self, model_id: str, need: int) -> None:
        """Unload least-recently-used idle, unpinned models until `need` more bytes fit, and
        collect what they leave now: before the next model's memory is measured."""
        if not self.max_memory:
            return
        used = sum(e.memory for e in self.entries.values())
        if used + need <= self.max_memory:
            return
        victims = sorted(  # no entry held here: the collection below would freeze it again
            (e.last_used, mid, e.memory)
            for mid, e in self.entries.items()
            if not e.engine.busy and not self.model_settings.get(mid).pinned
        )
        evicted = False
        for _, mid, memory in victims:
            if used + need <= self.max_memory:
                break
            log.info("evicting %s (least recently used) to make room for %s", mid, model_id)
            self.unload(mid, collect=False, reason="lru")
            used -= memory
            evicted = True
        if evicted:
            self._collect_unloaded()
        if used + need > self.max_memory:
            raise InsufficientMemoryError(
                f"Cannot load '{model_id}': it needs about {format_size(need)}, {format_size(used)} is "
                f"held by loaded models that are pinned or serving requests, and the limit "
                f"(--max-model-memory) is {format_size(self.max_memory)}. Unload or unpin a model, "
                "or raise the limit.",
                code="insufficient_memory",
            )

    # ----- warm start ---------------------------------------------------------------
    def models_to_warm(self, default: str | None = None) -> list[str]:
        """What a start loads (`warm_start.models_to_warm`), of the models discovered now."""
        known = self.discovery.models
        pinned = sorted(m for m in known if self.model_settings.get(m).pinned)
        wanted = models_to_warm(self.settings.model, self.loaded_models.ids, pinned, default)
        gone = [m for m in wanted if m not in known and m != self.settings.model]
        if gone:
            log.info("not loading %s at start: no longer in the model dir", ", ".join(gone))
        return [m for m in wanted if m not in gone]

    # ----- explicit control --------------------------------------------------------
    async def load(self, name: str) -> Entry:
        resolved = self.resolve(name)
        bind(model=resolved.info.id)
        return await self._ensure_loaded(resolved)

    def unload(self, model_id: str, collect: bool = True, reason: str = "request") -> bool:
        """Stop a model's engine and let it go (`reason` is counted for /metrics: request, lru,
        idle, memory, shutdown). What only the collector frees of it goes once
        the callers are done (soon, on the event loop: until they return they may hold its
        entry, and a pass then would freeze it again for good), or when the caller, passing
        `collect=False`, calls `_collect_unloaded`."""
        entry = self.entries.pop(model_id, None)
        if entry is None:
            return False
        entry.engine.shutdown()
        del entry
        self.unloads[(model_id, reason)] = self.unloads.get((model_id, reason), 0) + 1
        if reason != "shutdown":
            self.loaded_models.unloaded(model_id)
        log.info("unloaded %s", model_id)
        if collect and not self._collect_pending:
            self._collect_pending = True  # one pass for the models unloaded meanwhile
            try:
                asyncio.get_running_loop().call_soon(self._collect_unloaded)
            except RuntimeError:  # no event loop (a shutdown from plain code): now
                self._collect_unloaded()
        return True

    def _collect_unloaded(self) -> None:
        self._collect_pending = False
        freeze_heap(unfreeze=True)

    def state_of(self, model_id: str) -> str:
        if model_id in self.loading:
            return "loading"
        entry = self.entries.get(model_id)
        if entry is None:
            return "unloaded"
        return "serving" if entry.engine.busy else "loaded"

    def ttl_of(self, model_id: str) -> int:
        ms = self.model_settings.get(model_id)
        return ms.ttl if ms.ttl is not None else self.settings.idle_timeout

    def status(self) -> list[dict[str, Any]]:
        out = []
        for model_id, info in sorted(self.discovery.models.items()):
            entry = self.entries.get(model_id)
            ms = self.model_settings.get(model_id)
            engine: Any = entry.engine if entry else None
            out.append(
                {
                    "id": model_id,
                    "type": ms.type or info.type,
                    "state": self.state_of(model_id),
                    "memory_bytes": entry.memory if entry else 0,
                    "estimated_bytes": entry.estimate if entry else None,
                    "last_used": entry.last_used if entry else None,
                    "pinned": ms.pinned,
                    "ttl": self.ttl_of(model_id),
                    "active_requests": getattr(engine, "active_count", 0) if engine else 0,
                    "waiting_requests": getattr(engine, "waiting_count", 0) if engine else 0,
                    # each request in flight: id, state, prompt/cached/prefilled/completion tokens
                    # (a client polls `prefilled_tokens` for a long prompt's progress)
                    "requests": engine.requests_view() if hasattr(engine, "requests_view") else [],
                    # CUDA: the idle engine's dummy prompt (graph_warmup.py), {tokens, target, done}
                    "graph_warmup": getattr(engine, "graph_warmup_progress", None) if engine else None,
                    # KV memory admission (engine/kv_budget.py): the longest sequence memory holds,
                    # and the sequences paused so far because the running ones outgrew it
                    "max_sequence_tokens": getattr(engine, "max_sequence_tokens", None) if engine else None,
                    "paused_for_memory": getattr(engine, "paused_for_memory", 0) if engine else 0,
                    # seconds per part of the decode-only engine loops and the tokens they made
                    # (engine/step_clock.py), and the engine's and event loop's threads' CPU
                    "step_times": getattr(engine, "step_times", None) if engine else None,
                    # the model drafting for a request decoding alone (its `draft_model`, once loaded and usable)
                    "draft_model": getattr(getattr(engine, "loaded", None), "draft_id", None) if engine else None,
                }
            )
        return out

    # ----- idle expiry -------------------------------------------------------------
    def start_reaper(self, interval: float = 1.0) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever(interval))

    async def _reap_forever(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.reap_idle()

    def reap_idle(self) -> list[str]:
        now = time.time()
        expired = []
        for model_id, entry in list(self.entries.items()):
            ttl = self.ttl_of(model_id)
            if ttl and not entry.engine.busy and not self.model_settings.get(model_id).pinned:
                if now - entry.last_used >= ttl:
                    expired.append(model_id)
        for model_id in expired:
            log.info("unloading %s after %ss idle", model_id, self.ttl_of(model_id))
            self.unload(model_id, reason="idle")
        return expired

    def stop_generating(self, reason: str) -> None:
        """From any thread: every engine that generates fails what it holds and refuses new
        requests with `reason` (the server is going down)."""
        for entry in list(self.entries.values()):
            stop = getattr(entry.engine, "stop_generating", None)
            if stop is not None:
                stop(reason)

    def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for entry in list(self.entries.values()):  # all engines stop at once, then each is joined
            entry.engine.request_stop()
        for model_id in list(self.entries):
            self.unload(model_id, reason="shutdown")
