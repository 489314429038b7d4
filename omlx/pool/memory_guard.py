"""The process memory guard (`--max-process-memory`): a limit on the whole process's resident
memory (models, KV caches, cache tiers, the Python heap), checked every `CHECK_S` on the event
loop. Over it, in this order, one step per check until the process is back under:

1. each chat engine empties MLX's buffer cache (freed buffers MLX keeps for reuse);
2. the least recently used idle, unpinned model is unloaded;
3. the RAM and hot prefix-cache tiers halve their budgets (down to 0; blocks go to the SSD);
4. new requests wait up to `WAIT_S` for memory, then get 503 with Retry-After.

Back under the limit requests are admitted; under `RELIEF` of it the tiers get their configured
budgets again.
A model load that would cross the limit first unloads idle models, else gets that 503. MLX calls
run on engine threads (`engine.call`). Why and what was measured: docs/design/operations.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import psutil

from omlx.cache.sizes import format_size, parse_size
from omlx.errors import ServiceUnavailableError

log = logging.getLogger("omlx.pool")

CHECK_S = 0.5
WAIT_S = 2.0
RETRY_AFTER_S = 5
RELIEF = 0.9  # the tiers grow back once the process is under this share of its limit
ACTIONS = ("clear", "unload", "shrink", "refuse")


def process_rss() -> int:
    return psutil.Process().memory_info().rss


def parse_limit(text: str) -> int:
    """`--max-process-memory` in bytes: a size, or a share of RAM (ValueError says what is wrong)."""
    return parse_size(text, total=psutil.virtual_memory().total)


def _empty_mlx_cache() -> None:
    """On an engine's thread: hand MLX's cached free buffers back to the system."""
    import mlx.core as mx

    mx.clear_cache()


class MemoryGuard:
    """Keeps the process under `limit()` bytes (0: off). `pool` unloads; `store` has the tiers."""

    def __init__(self, pool: Any, store: Any, limit_setting: Any, rss: Any = process_rss):
        self.pool = pool
        self.store = store
        self._limit_setting = limit_setting  # () -> the setting's text, read at each check (live)
        self._rss = rss
        self.actions = dict.fromkeys(ACTIONS, 0)  # for /metrics
        self.over = False  # over the limit after every step was tried: requests wait or get 503
        self.last_rss = 0
        self._budgets: dict[str, int] | None = None  # the tiers' configured budgets while shrunk
        self._cleared = False  # step 1 ran since the last unload or shrink
        self._task: asyncio.Task | None = None

    def limit(self) -> int:
        text = str(self._limit_setting() or "0")
        try:
            return parse_limit(text)
        except ValueError as exc:
            log.warning("max_process_memory %r ignored: %s", text, exc)
            return 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(CHECK_S)
            try:
                await self.check()
            except Exception:  # the guard must outlive one bad check
                log.exception("the memory guard's check failed")

    async def check(self) -> None:
        """One step of relief if over the limit; the tiers back once under it."""
        limit, rss = self.limit(), self._rss()
        self.last_rss = rss
        if not limit or rss <= limit:
            self.over = self._cleared = False
            if not limit or rss <= RELIEF * limit:
                self._restore_tiers()
            return
        if await self._clear_buffers():
            return
        if self._unload_one():
            return
        if await self._shrink_tiers():
            return
        if not self.over:
            log.warning("process memory %s over the limit %s (--max-process-memory) with nothing left to "
                        "shed: new requests wait, then get 503", format_size(rss), format_size(limit))
        self.over = True

    def _llm_engines(self) -> list[Any]:
        return [e.engine for e in list(self.pool.entries.values()) if getattr(e.engine, "kind", "") == "llm"]

    async def _clear_buffers(self) -> bool:
        """Step 1, once after each rise, unload or shrink (what they freed went to MLX's cache)."""
        engines = self._llm_engines()
        if self._cleared or not engines:
            return False
        self._cleared = True
        await asyncio.gather(*(e.call(_empty_mlx_cache) for e in engines), return_exceptions=True)
        self.actions["clear"] += 1
        return True

    def _idle(self) -> list[tuple[str, int]]:
        """(model, bytes) of the idle, unpinned models, least recently used first."""
        entries = sorted(self.pool.entries.items(), key=lambda item: item[1].last_used)
        return [(model_id, entry.memory) for model_id, entry in entries
                if not entry.engine.busy and not self.pool.model_settings.get(model_id).pinned]

    def _unload(self, model_id: str) -> None:
        log.warning("unloading %s: the process is over its memory limit (--max-process-memory)", model_id)
        self.pool.unload(model_id, reason="memory")
        self.actions["unload"] += 1
        self._cleared = False  # its buffers went to MLX's cache: the next check empties it

    def _unload_one(self) -> bool:
        """Step 2: the least recently used idle, unpinned model, if any."""
        idle = self._idle()
        if idle:
            self._unload(idle[0][0])
        return bool(idle)

    async def _shrink_tiers(self) -> bool:
        """Step 3: halve the RAM and hot tiers' budgets (the RAM tier first, to 0)."""
        if self.store is None:
            return False
        tiers = [t for t in (self.store.warm, self.store.hot) if t is not None and t.max_bytes > 0]
        if not tiers:
            return False
        if self._budgets is None:
            self._budgets = {"warm": self.store.warm.max_bytes if self.store.warm else 0, "hot": self.store.hot.max_bytes}
        tier = tiers[0]
        target = tier.held_bytes // 2 if tier.held_bytes > (1 << 20) else 0  # half of what it holds
        engines = self._llm_engines()
        if engines:  # evicted blocks are handed on (to RAM, the SSD writer) on an engine's thread
            await engines[0].call(lambda: tier.set_max_bytes(target))
        else:
            tier.set_max_bytes(target)
        self.actions["shrink"] += 1
        self._cleared = False
        log.warning("%s cache tier budget shrunk to %s: the process is over its memory limit",
                    "RAM" if tier is self.store.warm else "hot", format_size(target))
        return True

    def _restore_tiers(self) -> None:
        if self._budgets is None or self.store is None:
            return
        if self.store.warm is not None:
            self.store.warm.set_max_bytes(self._budgets["warm"])
        self.store.hot.set_max_bytes(self._budgets["hot"])  # growing evicts nothing
        log.info("cache tiers back to their budgets: the process is under its memory limit")
        self._budgets = None

    async def admit(self) -> None:
        """Before a request takes an engine: wait up to `WAIT_S` while over, then 503."""
        deadline = time.monotonic() + WAIT_S
        while self.over and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.over:
            self.actions["refuse"] += 1
            raise ServiceUnavailableError(
                f"The server is over its process memory limit ({format_size(self.limit())}, "
                f"--max-process-memory; it uses {format_size(self.last_rss)}). Retry in {RETRY_AFTER_S} s.",
                retry_after=RETRY_AFTER_S,
                code="memory_limit",
            )

    def room_for(self, model_id: str, need: int) -> None:
        """Before loading `model_id` (about `need` bytes): when the load would cross the limit,
        unload idle unpinned models if that makes room (MLX reuses their buffers), else 503."""
        limit = self.limit()
        if not limit:
            return
        rss = self._rss()
        idle = self._idle()
        if rss + need - sum(nbytes for _, nbytes in idle) > limit:
            self.actions["refuse"] += 1
            raise ServiceUnavailableError(
                f"Cannot load '{model_id}' now: it needs about {format_size(need)}, the process uses "
                f"{format_size(rss)} and its limit (--max-process-memory) is {format_size(limit)}. "
                "Retry when other models are idle, or raise the limit.",
                retry_after=RETRY_AFTER_S,
                code="memory_limit",
            )
        for victim, nbytes in idle:
            if rss + need <= limit:
                break
            self._unload(victim)
            rss -= nbytes
