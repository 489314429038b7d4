"""Embedding and cross-encoder rerank engines: one thread per model owns every MLX call.

Routes tokenize on their side (no MLX) and submit token ids with `run()`. The engine
thread takes everything queued at that moment, sorts the sequences by length, cuts them
into micro-batches under a padded-token budget, runs one forward pass per micro-batch
(each padded only to its own longest sequence), and hands every request its rows. So
concurrent requests share forward passes, and a long sentence does not make a batch of
short ones pay for its padding.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from omlx.engine import activity
from omlx.engine.device_fault import DEVICE
from omlx.errors import EngineError, OverloadedError
from omlx.models.discovery import ModelInfo
from omlx.models.encoder_loader import Encoded, LoadedEncoder, load_encoder
from omlx.pool.memory import load_measured

log = logging.getLogger("omlx.engine")


@dataclass
class _Job:
    inputs: list[Encoded]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    rows: list[np.ndarray | None] | None = None


def plan_batches(lengths: list[int], max_tokens: int, max_size: int) -> list[list[int]]:
    """Indices grouped into micro-batches: sorted by length, each under the padded-token
    budget (batch size × its longest) and `max_size` rows. Pure bookkeeping."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[i]  # sorted ascending: the newcomer is the longest
        if current and ((len(current) + 1) * longest > max_tokens or len(current) >= max_size):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


class EncoderEngine:
    """Shared machinery; subclasses say what one forward pass computes."""

    kind = "encoder"

    def __init__(
        self,
        model_id: str,
        loader: Callable[[], LoadedEncoder],
        *,
        max_batch_tokens: int | None = None,
        max_batch_size: int | None = None,
        max_waiting: int = 256,
    ):
        self.model_id = model_id
        self._loader = loader
        self.loaded: LoadedEncoder | None = None
        self.memory_bytes = 0
        self.leases = 0
        self.context_length = 0
        # Micro-batch limits (padded tokens, rows). On a CPU small batches are fastest, a GPU
        # wants large ones (docs/design/prefill-grid.md, "Encoder micro-batches").
        on_cpu = mx.default_device() == mx.cpu
        self.max_batch_tokens = max_batch_tokens or (1024 if on_cpu else 16384)
        self.max_batch_size = max_batch_size or (16 if on_cpu else 128)
        self.max_waiting = max_waiting
        self.active_count = 0
        self.waiting_count = 0
        self._outstanding = 0  # event loop only
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        activity.register(self)  # its batches hold off other engines' idle GPU work
        self._thread = threading.Thread(
            target=self._run, name=f"{self.kind}:{model_id}", daemon=True
        )
        self._thread.start()

    # ----- asyncio side -------------------------------------------------------------
    async def wait_ready(self) -> None:
        if not self._ready.is_set():
            await asyncio.to_thread(self._ready.wait)
        if self._load_error is not None:
            raise self._load_error

    @property
    def busy(self) -> bool:
        return self._outstanding > 0 or self.leases > 0

    async def run(self, inputs: list[Encoded]) -> np.ndarray:
        """Rows of the forward pass for `inputs`, in order, stacked."""
        DEVICE.raise_if_lost()
        if self._outstanding >= self.max_waiting:
            raise OverloadedError(
                f"Model '{self.model_id}' has {self._outstanding} requests queued. Retry shortly.",
                retry_after=1,
            )
        loop = asyncio.get_running_loop()
        job = _Job(inputs, loop, loop.create_future())
        self._outstanding += 1
        try:
            self._inbox.put(job)
            return await job.future
        finally:
            self._outstanding -= 1

    def request_stop(self) -> None:
        """Ask the engine thread to stop after its current step (`shutdown` waits for it)."""
        self._stop.set()
        self._inbox.put(None)

    def shutdown(self, timeout: float = 10.0) -> None:
        self.request_stop()
        self._thread.join(timeout)

    # ----- engine thread ------------------------------------------------------------
    def forward(self, batch: list[Encoded]) -> mx.array:
        raise NotImplementedError

    def _load(self) -> bool:
        try:
            self.loaded, self.memory_bytes = load_measured(self._loader)
            self.context_length = self.loaded.max_length
            return True
        except BaseException as exc:  # reported to every waiter by wait_ready()
            DEVICE.check(exc)
            log.exception("loading %s failed", self.model_id)
            self._load_error = exc
            return False
        finally:
            self._ready.set()

    def _run(self) -> None:
        try:
            if not self._load():
                return
            with mx.stream(mx.new_stream(mx.default_device())):  # its own, not the shared default
                self._loop()
        finally:
            activity.unregister(self)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._inbox.get(timeout=0.5)
            except queue.Empty:
                continue
            jobs = [first]
            while True:
                try:
                    jobs.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            jobs = [j for j in jobs if j is not None]
            if jobs:
                self._serve(jobs)

    def _serve(self, jobs: list[_Job]) -> None:
        flat = [(j, i) for j in jobs for i in range(len(j.inputs))]
        for j in jobs:
            j.rows = [None] * len(j.inputs)
        self.active_count = len(jobs)
        tic = time.perf_counter()
        lengths = [len(j.inputs[i].ids) for j, i in flat]
        failed: dict[int, str] = {}
        for batch in plan_batches(lengths, self.max_batch_tokens, self.max_batch_size):
            members = [flat[k] for k in batch]
            live = [(j, i) for j, i in members if id(j) not in failed]
            if not live:
                continue
            try:
                out = self.forward([j.inputs[i] for j, i in live])
                mx.eval(out)
                rows = np.array(out, copy=True)
            except Exception as exc:  # an engine fault fails these requests, not the server
                DEVICE.check(exc)
                log.exception("%s failed a batch of %d", self.model_id, len(live))
                for j, _ in live:
                    failed[id(j)] = f"{type(exc).__name__}: {exc}"
                continue
            for (j, i), row in zip(live, rows, strict=True):
                j.rows[i] = row  # type: ignore[index]
        for j in jobs:
            if id(j) in failed:
                err = EngineError(
                    f"{self.kind} engine failure on '{self.model_id}': {failed[id(j)]}"
                )
                j.loop.call_soon_threadsafe(_set_exception, j.future, err)
            else:
                j.loop.call_soon_threadsafe(_set_result, j.future, np.stack(j.rows))  # type: ignore[arg-type]
        self.active_count = 0
        log.info(
            "model=%s %s requests=%d inputs=%d tokens=%d time=%.3fs",
            self.model_id,
            self.kind,
            len(jobs),
            len(flat),
            sum(lengths),
            time.perf_counter() - tic,
        )


class EmbeddingEngine(EncoderEngine):
    """Sentence embeddings: `run()` returns (n, dimensions) float32 rows."""

    kind = "embedding"

    def forward(self, batch: list[Encoded]) -> mx.array:
        return self.loaded.embed(batch)  # type: ignore[union-attr]


class RerankEngine(EncoderEngine):
    """Cross-encoder relevance: `run()` returns (n,) scores in 0..1."""

    kind = "reranker"

    def forward(self, batch: list[Encoded]) -> mx.array:
        return self.loaded.score(batch)  # type: ignore[union-attr]


def _set_result(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def encoder_factories(settings: Any) -> dict[str, Callable[[ModelInfo, Any], EncoderEngine]]:
    """The pool's factories for "embedding" and "reranker" models."""
    waiting = settings.max_concurrent_requests + settings.max_waiting_requests

    def make(cls: type[EncoderEngine]) -> Callable[[ModelInfo, Any], EncoderEngine]:
        def factory(info: ModelInfo, _model_settings: Any) -> EncoderEngine:
            return cls(
                info.id,
                lambda: load_encoder(info, cls.kind, settings.compute_dtype),
                max_waiting=waiting,
            )

        return factory

    return {"embedding": make(EmbeddingEngine), "reranker": make(RerankEngine)}
