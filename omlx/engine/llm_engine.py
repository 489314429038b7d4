"""One LLM engine per loaded model: a thread that owns every MLX call for that model.

The asyncio side calls `generate()`, which puts the request in the engine's inbox
and yields `GenerationEvent`s as the thread produces them. The thread admits
requests into mlx-lm's `BatchGenerator` (continuous batching), restores cached
prefixes, turns tokens into text with stop strings applied, and stores new
prefix-cache blocks. A request that arrives to an idle engine runs as a
`SoloSequence` (mlx-lm's single-sequence loop, cheaper per step) until a second one
arrives; then it joins the `BatchGenerator` with its cache. On a CUDA GPU newcomers
to a busy engine are prefilled by the engine itself, a chunk per step (chunks of one shape
in one forward pass), and join the batch with their last prompt token (why:
`omlx/engine/buffers.py`); elsewhere mlx-lm's batched prefill, which also pads prompts of
different lengths into one batch, is faster (8 streams on a 2-core CPU: TTFT 1.6 s vs 2.1 s,
measured before same-shape chunks were batched).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, StopSequences

from omlx.cache.kv_layout import kv_bytes_per_token
from omlx.engine import activity
from omlx.engine.buffers import trim_buffer_cache
from omlx.engine.cache_hooks import PrefixCacheHooks
from omlx.engine.device_fault import DEVICE, DeviceLostError
from omlx.engine.graph_warmup import MAX_RESTARTS, MEMORY_FRACTION, GraphWarmup
from omlx.engine.kv_budget import KvBudget
from omlx.engine.prefill_pacing import paced_step
from omlx.engine.prompt_logprobs import compute_prompt_logprobs
from omlx.engine.request import (
    GenerationEvent,
    GenerationRequest,
    SamplingParams,
    TokenLogprob,
    finite_logprob,
)
from omlx.engine.sampling import (
    Guarded,
    build_logits_processors,
    build_sampler,
    clear_faults,
    fault,
)
from omlx.engine.solo import (
    GRAPH_BUILD_S,
    PREFILL_QUANTUM,
    PrefillShapes,
    SoloSequence,
    align_cached,
    feed_chunks_together,
    first_chunk_shape,
    sdpa_graph_capacity,
)
from omlx.engine.stop_strings import StopStringMatcher
from omlx.errors import EngineError, OverloadedError, ServiceUnavailableError
from omlx.models.loader import LoadedLLM
from omlx.platform_info import discrete_gpu
from omlx.pool.memory import load_measured, memory_limit_total

log = logging.getLogger("omlx.engine")
# A request alone in the engine is prefilled in chunks of at least this many tokens where the
# engine prefills (a CUDA GPU), as raw mlx-lm does: no stream waits behind its chunks, and on an
# H200 an 8,000-token prefill of a 1B model took 0.089 s in 512-token chunks (the server's step)
# vs 0.059 s in 2,048-token ones (`decode_probe.py`); the server's 32,000-token TTFT was ~2x raw.
SOLO_PREFILL_TOKENS = 2048
# Finished requests whose blocks may wait to be stored a piece per idle loop; past it the
# oldest is stored at once (each holds its whole KV cache meanwhile).
MAX_PENDING_STORES = 2
# A prompt's blocks are stored once the event loop has passed its first token on to the
# response's writer (`_Handle.first_out`), or this many seconds after it was emitted (a loop too
# busy must not keep the blocks from later requests), or when the request is cancelled first.
# Started at once, the store's work (a slice per layer and block: 4,000 for 32,000 tokens of a
# 1B model) holds the GIL, which the loop then waits for at each iteration on the token's way
# out: 5.3 ms median, 10.4 max, against 0.15 ms (benchmarks/first_token_delivery_probe.py).
FIRST_TOKEN_GRACE_S = 0.05
# At a stop, finished requests' blocks are still stored for up to STOP_STORES_S, and the SSD
# writer is given STOP_WRITES_S to finish its queue (what is left is dropped, never half
# written): with the server's own grace, a SIGTERM ends the process within 15 s.
STOP_STORES_S = 2.0
STOP_WRITES_S = 5.0


@dataclass(eq=False)
class _Handle:
    """A request as the asyncio side holds it."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    done: bool = False
    taken: float | None = None  # when the engine first took it (a read-ahead may follow)
    queued: float = 0.0  # seconds from the API building the request to `taken`
    prefetched: Any = None  # its finished read-ahead, for `_insert`
    resume: Any = None  # the `_Running` state of a sequence paused for memory, to go on with
    admit_s: tuple[float, float] = (0.0, 0.0)  # finishing its prefix's stores, asking for a read-ahead
    first_out: bool = False  # its first event has left the event loop (`generate`)


@dataclass
class _Running:
    """A request as the engine thread holds it."""

    handle: _Handle
    uid: int
    detokenizer: Any
    stops: StopStringMatcher
    prompt_len: int
    cached_tokens: int
    start: float  # the engine took it (before its cached prefix was restored): TTFT counts from here
    prefill_start: float  # after the restore: a prefill's time counts from here
    reserved: int = 0  # tokens of KV memory reserved at admission (`KvBudget.reservation`)
    generated: list[int] = field(default_factory=list)  # token ids emitted so far
    sampler: Any = None  # kept for a hand-off: a seeded sampler's key state goes with it
    processors: list[Any] = field(default_factory=list)
    stop_sequences: Any = None
    # set while the request runs outside the BatchGenerator: decoding alone, or being prefilled
    solo: SoloSequence | None = None
    store_prompt: bool = False  # a solo prefill's prompt blocks are due to be stored
    queued: float = 0.0  # seconds from the API building the request to the engine taking it
    first_token: float | None = None
    completion_tokens: int = 0
    pending: GenerationEvent = field(default_factory=GenerationEvent)
    # a solo prefill's chunks (for the debug log: the device's time against the loop's)
    chunk_seconds: list[float] = field(default_factory=list)


class LLMEngine:
    def __init__(
        self,
        model_id: str,
        loader: Callable[[], LoadedLLM],
        *,
        max_concurrent: int = 8,
        max_waiting: int = 64,
        prefill_step_size: int = 512,
        solo: bool = True,
        own_prefill: bool | None = None,
        prefill_quantum: int | None = None,
        solo_prefill_step_size: int | None = None,
        prefix_cache_factory: Callable[[LoadedLLM], PrefixCacheHooks] | None = None,
        on_finished: Callable[[str, dict[str, Any]], None] | None = None,
        graph_warmup_tokens: int = 0,
        graph_shapes: bool | None = None,
        idle_empties_cache: bool | None = None,
        max_kv_memory: int | None = None,
    ):
        self.model_id = model_id
        self._on_finished = on_finished  # called on the engine thread with each request's numbers
        self._loader = loader
        self._prefix_cache_factory = prefix_cache_factory
        self.loaded: LoadedLLM | None = None
        self.model: Any = None
        self.tokenizer: Any = None
        self.context_length = 0
        self.eos_ids: list[int] = []
        self.model_vocab_size = 0
        self.max_concurrent = max_concurrent
        self.max_waiting = max_waiting
        self.prefill_step_size = prefill_step_size
        self.solo_enabled = solo  # a lone request decodes outside the BatchGenerator
        # newcomers to a busy engine prefilled here rather than by the BatchGenerator (None:
        # on a CUDA GPU, where mlx-lm's prefill empties MLX's buffer cache at a high price)
        self.own_prefill = discrete_gpu() if own_prefill is None else own_prefill
        # a lone request's chunks (None: `SOLO_PREFILL_TOKENS` where the engine prefills, else
        # the step); a multiple of the step, so that a hand-off mid-prompt leaves its chunks
        # on the step's grid, and then it goes on in steps (`_hand_off`)
        solo_step = solo_prefill_step_size or (SOLO_PREFILL_TOKENS if self.own_prefill else prefill_step_size)
        self.solo_prefill_step_size = max(1, -(-solo_step // prefill_step_size)) * prefill_step_size
        # where the engine prefills (a CUDA GPU), a dummy prompt this long is fed once while idle
        # so that MLX builds the attention graphs of the lone prefill's chunks (graph_warmup.py)
        self.graph_warmup_tokens = graph_warmup_tokens if self.own_prefill and solo else 0
        self._graph_warmup: GraphWarmup | None = None
        # the prefill chunks' attention shapes this thread has built graphs for (None: where
        # shapes cost nothing to meet; on a CUDA GPU by default): see `_onto_built_shapes`
        track = discrete_gpu() if graph_shapes is None else graph_shapes
        self._prefill_shapes = PrefillShapes(sdpa_graph_capacity()) if track else None
        self.graph_warmup_progress: dict[str, Any] | None = None  # published for /api/status
        self.prefix_cache: PrefixCacheHooks = PrefixCacheHooks()
        self._quantum_asked = prefill_quantum
        self.prefill_quantum = self._prefill_grid()
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self.memory_bytes = 0  # measured on the engine thread after loading
        self._max_kv_memory = max_kv_memory
        self.kv_budget: KvBudget | None = None  # measured at load (`kv_bytes_per_token`)
        # the longest sequence this device's memory could ever hold (None: not limited); routes
        # refuse longer prompts and clamp max_tokens to it
        self.max_sequence_tokens: int | None = None
        self.paused_for_memory = 0  # sequences paused so far because the running ones outgrew memory
        self.leases = 0  # held by routes between acquire and release (event loop only)
        self.kind = "llm"
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: deque[_Handle] = deque()
        # requests whose cached prefix is being made ready while the engine goes on
        # (`PrefixCacheHooks.prefetch`): read from the SSD, moved from RAM a chunk per loop (at
        # once when no other request runs or waits)
        self._restoring: dict[_Handle, Any] = {}
        self._running: dict[int, _Running] = {}
        self._by_request: dict[str, _Handle] = {}
        self._writes_held = False  # the SSD writer waits while a lone prompt is prefilled
        self._prompt_stores: list[int] = []  # uids whose prompt blocks are stored next step
        # Finished sequences' blocks, stored once every event of the step has gone out: with
        # an SSD tier each store copies KV to host memory (~2 GB/s on a CUDA GPU), and 32
        # streams finishing in one step must not wait on each other's copies.
        self._final_stores: list[tuple[list[int], list[Any]]] = []
        # Finished sequences whose blocks are stored a piece per idle loop (a hot tier that
        # holds no block sends each to RAM as it is made: done at once, a 32,000-token prompt
        # of an 8B model held the engine 3-8 s on an H200 while a new request waited).
        self._pending_stores: deque[tuple[list[int], list[Any], int]] = deque()  # (tokens, cache, from)
        self._solo_uid: int | None = None  # the request decoding as a SoloSequence, if any
        self._prefilling: list[int] = []  # newcomers the engine prefills, in arrival order
        self._own_uids = itertools.count(-1, -1)  # never collide with BatchGenerator's uids
        self.solo_handoffs = 0  # solo sequences moved into the BatchGenerator
        self._buffers_dirty = False  # MLX's buffer cache holds what steps left: empty it when idle
        # ... and whatever other threads freed into it (None: on a CUDA GPU): `_foreign_buffers_cached`
        self.idle_empties_cache = discrete_gpu() if idle_empties_cache is None else idle_empties_cache
        self._failures_seen = 0  # `Guarded.failures` when this engine last looked
        self._outstanding = 0  # reserved or submitted, and not finished (event loop only)
        self._reserved: set[str] = set()  # request ids with a place claimed, not yet submitted
        self._live: dict[str, _Handle] = {}  # submitted and not finished (event loop only)
        self.active_count = 0  # published by the engine thread for observers
        self.waiting_count = 0
        self._stop = threading.Event()
        self._stopping: str | None = None  # why new requests are refused (`stop_generating`)
        # Events wait here until their event loop runs `_deliver`: one wake-up per loop per step
        # however many streams advanced, and a loop that fell behind gets each stream's events
        # merged into one.
        self._outbox: dict[asyncio.AbstractEventLoop, dict[_Handle, GenerationEvent]] = {}
        self._outbox_lock = threading.Lock()
        self._bg: BatchGenerator | None = None
        self._stream: mx.Stream | None = None  # created on the engine thread
        activity.register(self)
        self._thread = threading.Thread(target=self._run, name=f"engine:{model_id}", daemon=True)
        self._thread.start()

    # ----- asyncio side -------------------------------------------------------------
    async def wait_ready(self) -> None:
        """Wait for the model to finish loading on the engine thread; re-raise its failure."""
        if not self._ready.is_set():
            await asyncio.to_thread(self._ready.wait)
        if self._load_error is not None:
            raise self._load_error

    def reserve(self, requests: list[GenerationRequest]) -> None:
        """Claim a place (running or waiting) for each request before its response starts, or
        raise `OverloadedError` (429) for all of them: a stream refused later could only say so
        in-band. `generate` then takes the place; `release` gives back what was not taken."""
        DEVICE.raise_if_lost()
        if self._stopping is not None:
            raise ServiceUnavailableError(self._stopping)
        if self._outstanding + len(requests) > self.max_concurrent + self.max_waiting:
            raise OverloadedError(
                f"Model '{self.model_id}' is busy: {self.max_concurrent} requests running and "
                f"{self.max_waiting} waiting. Retry shortly.",
                retry_after=2,
            )
        self._outstanding += len(requests)
        self._reserved.update(r.request_id for r in requests)

    def release(self, requests: list[GenerationRequest]) -> None:
        """The caller is done with `requests`: places not taken go back, and any request still
        running is cancelled (its client left)."""
        for r in requests:
            if r.request_id in self._reserved:
                self._reserved.discard(r.request_id)
                self._outstanding -= 1
            handle = self._live.get(r.request_id)
            if handle is not None and not handle.done:
                handle.done = True
                self._inbox.put(("cancel", r.request_id))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Submit a request and stream its events; closing the iterator cancels it."""
        if self._stopping is not None:
            raise ServiceUnavailableError(self._stopping)
        if request.request_id in self._reserved:
            self._reserved.discard(request.request_id)
        else:
            self.reserve([request])
            self._reserved.discard(request.request_id)
        handle = _Handle(request, asyncio.get_running_loop(), asyncio.Queue())
        self._live[request.request_id] = handle
        self._inbox.put(("submit", handle))
        try:
            while True:
                event: GenerationEvent = await handle.events.get()
                while event.finish_reason is None and not handle.events.empty():
                    event.merge(handle.events.get_nowait())
                if event.finish_reason is not None:
                    handle.done = True
                yield event
                if not handle.first_out:
                    # Runs after the callbacks queued so far, among them the wake-up of whoever
                    # took the event on (an SSE stream's writer, `with_keepalive`): by then the
                    # event is on its way out, and the engine may store the prompt's blocks.
                    handle.loop.call_soon(_mark_first_out, handle)
                if handle.done:
                    return
        finally:
            self._outstanding -= 1
            self._live.pop(request.request_id, None)
            if not handle.done:
                handle.done = True
                self._inbox.put(("cancel", request.request_id))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between steps (MLX work such as tokenize-free scoring)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._inbox.put(("call", fn, loop, future))
        return await future

    def stats(self) -> dict[str, Any]:
        return {"active": self.active_count, "waiting": self.waiting_count}

    def stop_generating(self, reason: str) -> None:
        """From any thread: fail every request held or arriving from now on with `reason`
        (the server is going down; their clients get an answer, not a cut connection)."""
        self._stopping = reason
        self._inbox.put(("fail_all", reason))

    def request_stop(self) -> None:
        """Ask the engine thread to stop after its current step (`shutdown` waits for it)."""
        self._stop.set()
        self._inbox.put(("stop",))

    def shutdown(self, timeout: float = 10.0) -> None:
        self.request_stop()
        self._thread.join(timeout)

    # ----- engine thread ------------------------------------------------------------
    def _new_batch_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self.model,
            stream=self._stream,
            max_tokens=1,
            stop_tokens=[[t] for t in self.eos_ids],
            completion_batch_size=self.max_concurrent,
            prefill_batch_size=self.prefill_batch_size,
            prefill_step_size=self.prefill_step_size,
        )

    @property
    def prefill_batch_size(self) -> int:
        """Newcomers prefilled per step (each by a chunk), as mlx-lm's own prefill would."""
        return min(8, self.max_concurrent)

    @property
    def busy(self) -> bool:
        """Requests submitted or leased and not finished: such an engine is never evicted."""
        return self._outstanding > 0 or self.leases > 0

    def _prefill_grid(self) -> int:
        """Prefill chunks start and end on multiples of this (solo.py says why; 0: anywhere).
        By default on a CUDA GPU, where the engine prefills every prompt itself: the prefix
        cache's block size (a restored prefix is then used in whole blocks), else 256. Chunks
        end on multiples of the step too, so it must be one of them."""
        q = self._quantum_asked
        if q is None:
            q = (self.prefix_cache.block_size or PREFILL_QUANTUM) if self.own_prefill else 0
        return q if q and self.prefill_step_size % q == 0 else 0

    def _load(self) -> bool:
        try:
            loaded, self.memory_bytes = load_measured(self._loader)
            self.loaded, self.model, self.tokenizer = loaded, loaded.model, loaded.tokenizer
            self.context_length = loaded.context_length
            self.eos_ids = sorted(set(loaded.tokenizer.eos_token_ids or []))
            args = getattr(loaded.model, "args", None)
            self.model_vocab_size = getattr(args, "vocab_size", None) or len(loaded.tokenizer)
            if self._prefix_cache_factory is not None:
                self.prefix_cache = self._prefix_cache_factory(loaded)
                self.prefill_quantum = self.prefix_cache.grid = self._prefill_grid()
            # One stream per engine, for everything it computes (steps, restores, stores,
            # scoring): mlx-lm's default `generation_stream` is shared by every BatchGenerator in
            # the process, and mixing streams within an engine made MLX's CUDA backend hang.
            self._stream = mx.new_stream(mx.default_device())
            self._bg = self._new_batch_generator()
            with mx.stream(self._stream):
                self._warm_up()
            self._graph_warmup = self._new_graph_warmup()
            self.kv_budget = KvBudget(kv_bytes_per_token(self.model), memory_limit_total(), self._max_kv_memory)
            self.max_sequence_tokens = self.kv_budget.most_tokens(self.memory_bytes)
            return True
        except BaseException as exc:  # reported to every waiter by wait_ready()
            DEVICE.check(exc)
            log.exception("loading %s failed", self.model_id)
            self._load_error = exc
            return False
        finally:
            self._ready.set()

    def _warm_up(self) -> None:
        """Generate a few tokens once at load, through the paths requests take.

        MLX builds some kernels on first use (the CUDA backend compiles them at run time);
        measured on an H200, the first batch whose prompts differed in length took 8 s.
        Paying that here keeps it out of the first users' TTFT."""
        tic = time.perf_counter()
        try:
            ids = self.tokenizer.encode("Warm up: the quick brown fox jumps over the lazy dog. " * 3)
            ids = ([t for t in ids if t not in self.eos_ids] * 4)[:24]
            sampled = SamplingParams(temperature=0.7, top_p=0.9, logit_bias={ids[0]: -1.0})
            # newcomers join the batch two at once, then one, one of them sampled with
            # processors: prefilled here in chunks (own_prefill) or by the BatchGenerator,
            # whose prompts of different lengths take its padded path
            newcomers = [
                (ids[:9], None, []),
                (ids[:15], build_sampler(sampled), build_logits_processors(sampled)),
                (ids[:5], None, []),
            ]
            for group in (newcomers[:2], newcomers[2:]):
                seqs = [
                    SoloSequence(
                        self.model, prompt, cache=None, cached=[], sampler=sampler,
                        logits_processors=processors, prefill_step_size=4,
                    )  # fmt: skip
                    for prompt, sampler, processors in group
                ]
                if self.own_prefill:  # the first two's first chunks go in one batch
                    while not all(feed_chunks_together(seqs)):
                        pass
                for seq, (prompt, sampler, processors) in zip(seqs, group, strict=True):
                    todo, cache, fed = prompt, None, None
                    if self.own_prefill:
                        seq.wait()
                        todo, cache, fed = seq.handoff()
                    self._bg.insert(
                        [todo], max_tokens=[3], caches=[cache] if cache else None,
                        all_tokens=[fed] if fed else None,
                        samplers=[sampler] if sampler is not None else None, logits_processors=[processors],
                    )  # fmt: skip
                self._bg.next()
            finished = 0
            for _ in range(256):  # bounded: 3 sequences of <= 3 tokens
                _, generated = self._bg.next()
                finished += sum(1 for r in generated if r.finish_reason is not None)
                if finished == 3:
                    break
            if self.solo_enabled:  # chunked prefill, then pipelined decode, on a plain cache
                solo = SoloSequence(
                    self.model, ids[:11], cache=None, cached=[], sampler=None,
                    logits_processors=build_logits_processors(sampled), prefill_step_size=4,
                )
                while not solo.prefill():
                    pass
                for launch in (True, True, False):
                    solo.next(launch=launch)
        except Exception:  # a warm-up is an optimisation; the model still serves
            log.warning("warm-up of %s failed", self.model_id, exc_info=True)
            self._bg.close()
            self._bg = self._new_batch_generator()
        mx.clear_cache()
        log.info("warmed up %s in %.2fs", self.model_id, time.perf_counter() - tic)

    def _new_graph_warmup(self) -> GraphWarmup | None:
        depth = min(self.graph_warmup_tokens, self.context_length or self.graph_warmup_tokens)
        if depth < self.solo_prefill_step_size:
            return None
        from omlx.cache.setup import hot_tier_total_bytes  # the device's memory

        token = next((t for t in self.tokenizer.encode("warm up") if t not in self.eos_ids), 0)
        warmup = GraphWarmup(
            self.model, depth, self.solo_prefill_step_size, token, int(hot_tier_total_bytes() * MEMORY_FRACTION),
            self._prefill_shapes,
        )
        self.graph_warmup_progress = warmup.progress()
        return warmup

    def _warm_graphs(self, idle: bool) -> None:
        """One chunk of the graph warm-up when the process is idle; pause it otherwise."""
        warmup = self._graph_warmup
        assert warmup is not None
        if not idle:
            warmup.pause()
        else:
            try:
                warmup.feed()
                trim_buffer_cache()  # its cache grows by concatenation, as a prompt's does
            except Exception as exc:
                if DEVICE.check(exc):
                    raise
                log.warning("attention-graph warm-up of %s failed", self.model_id, exc_info=True)
                warmup.close(f"failed: {exc}")
        self.graph_warmup_progress = warmup.progress()
        if not warmup.over:
            return
        self._graph_warmup = None
        self._buffers_dirty = True  # what it left in MLX's buffer cache goes when idle
        if warmup.done:
            log.info(
                "built the attention graphs of %s for prompts up to %d tokens in %.2fs (%d chunks, started over %d times after requests)",
                self.model_id, warmup.depth, warmup.seconds, warmup.depth // warmup.step, warmup.pauses,
            )  # fmt: skip
        elif warmup.pauses >= MAX_RESTARTS:
            log.info("attention-graph warm-up of %s: %s", self.model_id, warmup.error)

    def _run(self) -> None:
        try:
            self._load_and_loop()
        finally:
            activity.unregister(self)

    def _load_and_loop(self) -> None:
        if not self._load():
            self._close_prefix_cache(timeout=0.0)  # it may have been made before the failure
            return
        try:
            with mx.stream(self._stream):
                try:
                    self._loop()
                finally:  # stopping: what waits for the SSD goes now (shutdown() joins for 10 s)
                    if self._graph_warmup is not None:
                        self._graph_warmup.close("the engine stopped")
                    self._hold_writes(False)
                    self._drop_pending_stores(seconds=STOP_STORES_S)
                    self._close_prefix_cache(timeout=STOP_WRITES_S)
        finally:
            self._bg.close()

    def _close_prefix_cache(self, timeout: float) -> None:
        try:
            self.prefix_cache.close(timeout=timeout)
        except Exception:
            log.exception("closing the prefix cache of %s failed", self.model_id)

    def _loop(self) -> None:
        unwritten = False  # stored blocks wait for the SSD and the writer takes more: go on soon
        while not self._stop.is_set():
            if DEVICE.lost is not None:  # nothing can run here any more: answer whatever comes
                error = DeviceLostError(DEVICE.lost).message
                for state in list(self._running.values()):  # lost on another engine's thread
                    self._finish(state, "error", error=error)
                self._fail_queued(error)
                self._hold_writes(False)
                self.active_count = self.waiting_count = 0
                self._drain_inbox(block=True)
                continue
            idle = not self._running and not self._waiting
            try:
                moving = self._moving_from_ram()
                # the graph warm-up goes on only while no engine of the process has requests
                warming = (
                    self._graph_warmup is not None and idle and not self._restoring and not activity.others_busy(self)
                )
                self._drain_inbox(block=idle and not unwritten and not moving and not warming)
                self._admit()
                self._hold_writes(self._prefilling_alone())
                if self._graph_warmup is not None:
                    alone = not self._running and not self._waiting and not self._restoring
                    self._warm_graphs(idle=alone and not activity.others_busy(self))
                if self._running:
                    self._step()
                    self._buffers_dirty = True
                    self._pause_if_outgrown()
                    if Guarded.failures != self._failures_seen:
                        self._fail_sampling_faults()
                self._store_finished()
                # idle, and no request waiting for this thread to move its cached prefix in from
                # RAM: that restore is all of its TTFT, and the copies out would lengthen it
                idle = not self._running and not self._waiting and not self._moving_from_ram()
                if not self._prefilling_alone():  # else its TTFT would carry the copies
                    unwritten = self._write_back(idle)
                    if idle and self._pending_stores:
                        unwritten = self._continue_store() or unwritten
                if idle and not unwritten and (self._buffers_dirty or self._foreign_buffers_cached()):
                    self._buffers_dirty = False
                    mx.clear_cache()  # idle: nobody waits on it now
                if idle and not unwritten and not activity.others_busy(self):
                    self._probe_idle()
            except Exception as exc:  # an engine fault fails the requests in flight, not the server
                lost = DEVICE.check(exc)
                log.exception("engine %s failed a step; failing %d requests", self.model_id, len(self._running))
                for state in list(self._running.values()):
                    self._finish(state, "error", error=f"engine failure: {exc}")
                self._hold_writes(False)
                if lost:  # so would every later step: the next loop answers the queued ones
                    continue
                self._bg = self._new_batch_generator()
                self._prompt_stores = []
                self._final_stores = []
                self._pending_stores.clear()
                self._solo_uid = None
                self._prefilling = []
            self.active_count = len(self._running)
            self.waiting_count = len(self._waiting) + len(self._restoring)

    def _fail_sampling_faults(self) -> None:
        """Fail, alone, the requests whose own sampler or logits processors failed in this
        step (they fell back so the step could go on for the others)."""
        self._failures_seen = Guarded.failures
        failed = [(state, error) for state in list(self._running.values())
                  if (error := fault(state.sampler, state.processors)) is not None]
        for state, error in failed:
            log.warning("request=%s: sampling failed: %s", state.handle.request.request_id, error)
            self._drop(state)
            self._finish(state, "error", error=f"sampling failed: {error}")
        clear_faults(g for state, _ in failed for g in (state.sampler, *state.processors))

    def _hold_writes(self, on: bool) -> None:
        if on != self._writes_held:
            self._writes_held = on
            self.prefix_cache.hold_writes(on)

    def _fail_all(self, error: str) -> None:
        """Answer every request held with `error`; running ones stop computing now."""
        for state in list(self._running.values()):
            self._drop(state)
            self._finish(state, "error", error=error)
        self._fail_queued(error)

    def _fail_queued(self, error: str) -> None:
        """Answer every request not yet running with `error` (the device is lost)."""
        queued = [*self._waiting, *self._restoring]
        self._waiting.clear()
        self._restoring.clear()
        for handle in queued:
            self._by_request.pop(handle.request.request_id, None)
        self._emit_many([(handle, GenerationEvent(finish_reason="error", error=error)) for handle in queued])

    def _prefilling_alone(self) -> bool:
        """A lone request's prompt is being fed: its prefill is all of its TTFT, and no other
        stream is slowed by waiting. Copies of stored blocks to RAM or the SSD (the engine is
        busy, so due then only by their bounds or an eviction) wait for its end: on an H200,
        at 32,000 tokens, a miss whose prefill loops each copied 16 MB device -> host came out
        0.1-0.2 s slower than `--no-cache`. The engine's next loop after the prefill does them.
        The SSD writer waits too (`hold_writes`): a 32,000-token miss whose prefill ran while
        the previous prompt's 1 GB of blocks were being written came out 0.057 s slower than
        `--no-cache` on the H200, 0.014 s with the writer held."""
        if self._solo_uid is None:
            return False
        state = self._running.get(self._solo_uid)
        return state is not None and state.solo is not None and state.solo.prefilling

    def _moving_from_ram(self) -> bool:
        """Whether a request's cached prefix is being moved in from RAM by this thread (a chunk
        per loop, `PrefixCacheHooks.advance`); reads from the SSD go on off it."""
        return any(getattr(p, "needs_engine", False) for p in self._restoring.values())

    def _foreign_buffers_cached(self) -> bool:
        """Whether MLX's buffer cache holds buffers that others freed (the SSD writer's copies of
        blocks, the RAM tier's) and no engine of the process is busy. On CUDA a buffer the host
        has read is managed memory, and the cache hands it out again for device work, which then
        faults its pages back at ~7 GB/s: on an H200 a 32,000-token prefill at 1B took 0.50 s
        instead of 0.37 s in the buffers of the previous prompt's blocks the writer had freed.
        Not while the graph warm-up runs: what it frees is its own, for its next chunk."""
        return (
            self.idle_empties_cache
            and self._graph_warmup is None
            and mx.get_cache_memory() > 0
            and not activity.others_busy(self)
        )

    def _drain_inbox(self, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind = msg[0]
            if kind == "submit":
                handle = msg[1]
                self._waiting.append(handle)
                self._by_request[handle.request.request_id] = handle
            elif kind == "restored":  # a read-ahead is over: `_admit` looks at it now
                pass
            elif kind == "cancel":
                self._cancel(msg[1])
            elif kind == "fail_all":
                self._fail_all(msg[1])
            elif kind == "call":
                _, fn, loop, future = msg
                try:
                    DEVICE.raise_if_lost()
                    result = fn()
                except Exception as exc:  # delivered to the awaiting caller
                    DEVICE.check(exc)
                    loop.call_soon_threadsafe(_set_exception, future, exc)
                else:
                    loop.call_soon_threadsafe(_set_result, future, result)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _cancel(self, request_id: str) -> None:
        handle = self._by_request.pop(request_id, None)
        if handle is None:
            return
        if handle in self._waiting:
            self._waiting.remove(handle)
            return
        if self._restoring.pop(handle, None) is not None:
            return
        for uid, state in list(self._running.items()):
            if state.handle is handle:
                self._store_computed_prompt(uid, state)
                self._drop(state)
                del self._running[uid]
                self._log_finished(state, "cancelled")

    def _store_computed_prompt(self, uid: int, state: _Running) -> None:
        """A request cancelled keeps what its prompt computed: a prompt store waiting for the
        first token is made now, and a prefill cut short stores the blocks fed so far, so a
        client that retries continues where it left (before the sequence's cache goes)."""
        if state.solo is not None:
            solo = state.solo
            if solo.prefilling:
                fed = solo.fed[: state.prompt_len]
                if self.prefix_cache.wants_prompt_blocks(len(fed), state.cached_tokens):
                    self._store(fed, solo.cache, final=False)
            else:
                self._store_solo_prompt(state, now=True)
        elif uid in self._prompt_stores or state.first_token is None:
            if uid in self._prompt_stores:
                self._prompt_stores.remove(uid)
            self._store_batch_prompt(uid, state)

    def _drop(self, state: _Running) -> None:
        """Stop computing a sequence that ends before its generator says so."""
        if state.solo is not None:
            if state.uid == self._solo_uid:
                self._solo_uid = None
            if state.uid in self._prefilling:
                self._prefilling.remove(state.uid)
        else:
            self._bg.remove([state.uid])

    def _advance_restoring(self) -> None:
        """Move on the prefetches of requests whose cached prefix is being restored (one of
        them moves a chunk to device memory per loop, all of it when no other request runs or
        waits); those ready go first in line."""
        mover = next((p for p in self._restoring.values() if getattr(p, "needs_engine", False)), None)
        alone = not self._running and not self._waiting
        ready: list[tuple[_Handle, Any]] = []
        for handle, prefetched in self._restoring.items():
            try:
                if self.prefix_cache.advance(prefetched, move=prefetched is mover, alone=alone):
                    ready.append((handle, prefetched))
            except Exception:  # caching is an optimisation: `lookup` restores in line instead
                log.exception("restoring the cached prefix of %s ahead failed", handle.request.request_id)
                ready.append((handle, None))
        for handle, prefetched in reversed(ready):
            del self._restoring[handle]
            handle.prefetched = prefetched
            self._waiting.appendleft(handle)

    def _admit(self) -> None:
        if self._restoring:
            self._advance_restoring()
        if self._waiting and self._solo_uid is not None and self.max_concurrent > 1:
            self._hand_off()  # a second request: the solo one joins the batch first
        deferred: list[_Handle] = []
        while self._waiting and len(self._running) + len(self._restoring) < self.max_concurrent:
            handle = self._waiting.popleft()
            if self._shares_a_prefill(handle):
                deferred.append(handle)
                continue
            if not self._kv_fits(handle):
                self._waiting.appendleft(handle)  # first in line: it goes when memory frees up
                break
            try:
                if handle.taken is None:
                    handle.taken = time.perf_counter()
                    handle.queued = max(0.0, time.time() - handle.request.created)
                    self._finish_stores_for(handle.request.prompt_tokens)
                    asked = time.perf_counter()
                    ahead = self._read_ahead(handle)
                    handle.admit_s = (asked - handle.taken, time.perf_counter() - asked)
                    if ahead:
                        continue
                self._insert(handle)
            except Exception as exc:
                DEVICE.check(exc)
                log.exception("request %s failed at admission", handle.request.request_id)
                self._by_request.pop(handle.request.request_id, None)
                self._emit(handle, GenerationEvent(finish_reason="error", error=str(exc)))
        self._waiting.extendleft(reversed(deferred))

    def _kv_held(self, actual: bool = False) -> int:
        """Bytes of KV the running sequences hold (`actual`) or have reserved, if more."""
        bpt = self.kv_budget.bytes_per_token if self.kv_budget else 0
        return bpt * sum(
            s.prompt_len + s.completion_tokens if actual else max(s.reserved, s.prompt_len + s.completion_tokens)
            for s in self._running.values()
        )

    def _kv_room(self, held: int) -> int:
        return self.kv_budget.room(mx.get_active_memory(), held, self.prefix_cache.hot_bytes())

    def _kv_fits(self, handle: _Handle) -> bool:
        """Whether the request's reservation fits next to what the running sequences hold; the
        hot tier yields memory first. One alone always goes (a prompt that can never fit was
        refused at the route)."""
        budget = self.kv_budget
        if handle.resume is not None or not budget or not budget.bytes_per_token or not self._running:
            return True
        req = handle.request
        need = budget.reservation(len(req.prompt_tokens), req.max_tokens) * budget.bytes_per_token
        held = self._kv_held()
        short = held + need - self._kv_room(held)
        return short <= 0 or self.prefix_cache.yield_memory(short) >= short

    def _pause_if_outgrown(self) -> None:
        """When the decoding sequences have outgrown the room (the hot tier yielding first),
        the newest is paused: its cache goes to the prefix cache's tiers and it waits first in
        line, to go on from there once there is room."""
        if len(self._running) < 2 or not self.kv_budget or not self.kv_budget.bytes_per_token:
            return
        held = self._kv_held(actual=True)
        short = held - self._kv_room(held)
        if short <= 0 or self.prefix_cache.yield_memory(short) >= short:
            return
        batch = [s for s in self._running.values() if s.solo is None and s.first_token is not None]
        if len(batch) < 2:
            return
        state = max(batch, key=lambda s: s.start)
        found = self._bg.remove([state.uid], return_prompt_caches=True).get(state.uid)
        del self._running[state.uid]
        if found is not None:
            start = self._store(list(found[1]), found[0], final=True)
            if start:
                self._pending_stores.append((list(found[1]), found[0], start))
            self.prefix_cache.yield_memory((state.prompt_len + state.completion_tokens) * self.kv_budget.bytes_per_token)
        self.paused_for_memory += 1
        log.info("request=%s paused: running sequences outgrew KV memory (%d bytes short)",
                 state.handle.request.request_id, short)
        state.handle.resume = state
        self._waiting.appendleft(state.handle)

    def _resume(self, handle: _Handle) -> None:
        """Insert a paused sequence again: its prompt and the tokens it generated, as far as
        cached, restored; it goes on from its last token."""
        state = handle.resume
        handle.resume = None
        tokens = state.handle.request.prompt_tokens + state.generated
        cache, cached = self.prefix_cache.lookup(tokens)
        cached = min(cached, len(tokens) - 1)
        if cache is not None and cached < cache[0].offset:
            for c in cache:
                c.trim(c.offset - cached)
        left = state.handle.request.max_tokens - state.completion_tokens
        state.uid = self._batch_insert(state, tokens[cached:], cache if cached else None, tokens[:cached], left)
        self._running[state.uid] = state

    def _shares_a_prefill(self, handle: _Handle) -> bool:
        """Whether a running request is still computing (or about to store) at least half of
        this one's prompt: it waits for those blocks rather than computing them a second time
        (eight retries of one 18,798-token prompt once prefilled side by side, from zero)."""
        block = self.prefix_cache.block_size
        prompt = handle.request.prompt_tokens
        if not block or len(prompt) < 2 * block:
            return False
        for uid, state in self._running.items():
            if not (state.first_token is None or state.store_prompt or uid in self._prompt_stores):
                continue
            shared = _shared_blocks(prompt, state.handle.request.prompt_tokens[: state.prompt_len], block)
            if shared - state.cached_tokens >= block and 2 * shared >= len(prompt):
                return True
        return False

    def _read_ahead(self, handle: _Handle) -> bool:
        """Whether the request's cached prefix is being made ready ahead (read from the SSD
        off this thread, moved from RAM a chunk per loop while others run); done in `lookup`,
        every running stream would wait for it."""
        req = handle.request
        if req.max_tokens <= 0:
            return False
        prefetched = self.prefix_cache.prefetch(req.prompt_tokens, lambda: self._inbox.put(("restored", handle)))
        if prefetched is None:
            return False
        log.debug("request=%s restores its cached prefix ahead", req.request_id)
        self._restoring[handle] = prefetched
        return True

    def _insert(self, handle: _Handle) -> None:
        if handle.resume is not None:
            self._resume(handle)
            return
        req = handle.request
        tokens = req.prompt_tokens
        queued, taken = handle.queued, handle.taken or time.perf_counter()  # set by `_admit`
        prompt_logprobs = None
        if req.prompt_logprobs is not None:
            prompt_logprobs = compute_prompt_logprobs(self.model, tokens, req.prompt_logprobs)
        if req.max_tokens <= 0:
            self._by_request.pop(req.request_id, None)
            self._emit(
                handle,
                GenerationEvent(
                    finish_reason="length", prompt_tokens=len(tokens), prompt_logprobs=prompt_logprobs
                ),
            )
            return
        if handle.prefetched is not None:
            self.prefix_cache.take(handle.prefetched)
            handle.prefetched = None
        looked = time.perf_counter()
        cache, cached = self.prefix_cache.lookup(tokens)
        cache, cached = align_cached(cache, cached, self.prefill_quantum)
        alone = self.solo_enabled and not self._running and not self._waiting
        own = alone or (self.own_prefill and len(tokens) - cached > 1)
        step = self.solo_prefill_step_size if alone else self.prefill_step_size
        shaped = time.perf_counter()
        if own:
            cache, cached = self._onto_built_shapes(cache, cached, len(tokens), step)
        if log.isEnabledFor(logging.DEBUG):  # where a request's `restore=` time goes
            now = time.perf_counter()
            log.debug(
                "request=%s admitted in %.4fs: stores %.4fs, read-ahead asked %.4fs, lookup %.4fs, shapes %.4fs,"
                " other %.4fs (a read-ahead's wait, prompt logprobs)",
                req.request_id, now - taken, *handle.admit_s, shaped - looked, now - shaped,
                looked - taken - sum(handle.admit_s),
            )  # fmt: skip
        stop_seqs = None
        if req.stop_token_ids:
            stop_seqs = StopSequences([[t] for t in sorted(set(self.eos_ids) | set(req.stop_token_ids))])
        state = _Running(
            handle=handle,
            uid=0,
            detokenizer=self.tokenizer.detokenizer,
            stops=StopStringMatcher(req.stop),
            prompt_len=len(tokens),
            cached_tokens=cached,
            start=taken,
            prefill_start=time.perf_counter(),
            sampler=build_sampler(req.sampling),
            processors=build_logits_processors(req.sampling),
            stop_sequences=stop_seqs,
            queued=queued,
        )
        if own:
            # decodes alone, or is prefilled here and joins the batch with its last token
            state.uid = next(self._own_uids)
            state.solo = SoloSequence(
                self.model, tokens[cached:], cache=cache, cached=tokens[:cached], sampler=state.sampler,
                logits_processors=state.processors, prefill_step_size=step, quantum=self.prefill_quantum,
                shapes=self._prefill_shapes,
            )
            if alone:
                self._solo_uid = state.uid
            else:
                self._prefilling.append(state.uid)
        else:
            state.uid = self._batch_insert(state, tokens[cached:], cache, tokens[:cached], req.max_tokens)
        state.pending.prompt_logprobs = prompt_logprobs
        if self.kv_budget is not None:
            state.reserved = self.kv_budget.reservation(len(tokens), req.max_tokens)
        self._running[state.uid] = state
        self.prefix_cache.record(len(tokens), cached)

    def _onto_built_shapes(
        self, cache: list[Any] | None, cached: int, prompt_len: int, step: int
    ) -> tuple[list[Any] | None, int]:
        """A restored prefix that ends between two multiples of the chunk `step` gives the
        prefill a first chunk of a shape that prefills from the start never have (say 1,792
        queries over 2,048 keys after a 256-token restore), whose attention graph may not
        exist: ~40 ms to build on an H200 (`GRAPH_BUILD_S`), seen as +0.1 s on the first
        restore from the SSD after a restart. Cut back to the multiple below when this thread
        has built that one's shape and not the other, and recomputing the tokens cut costs
        less than a build (the prefix cache's prefill model). Only when the prompt goes on
        past the multiple above: a prompt that ends before it has a last chunk's shape either
        way, and cutting would only trade one such shape for another."""
        shapes, q = self._prefill_shapes, self.prefill_quantum
        extra = cached % step if cache is not None and shapes is not None else 0
        if not extra or prompt_len - 1 - cached <= step - extra:
            return cache, cached
        base = cached - extra
        if first_chunk_shape(cached, prompt_len - cached, step, q) in shapes:
            return cache, cached
        if first_chunk_shape(base, prompt_len - base, step, q) not in shapes:
            return cache, cached  # a graph to build either way
        recompute = self.prefix_cache.prefill_seconds(extra, base)
        if recompute is None or recompute >= GRAPH_BUILD_S:
            return cache, cached
        return align_cached(cache, cached, step)

    def _batch_insert(
        self, state: _Running, todo: list[int], cache: list[Any] | None, fed: list[int], max_tokens: int
    ) -> int:
        return self._bg.insert(
            [todo],
            max_tokens=[max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[fed] if fed else None,
            samplers=[state.sampler] if state.sampler is not None else None,
            logits_processors=[state.processors],
            stop_sequences=[state.stop_sequences] if state.stop_sequences is not None else None,
        )[0]

    def _hand_off(self) -> None:
        """Move the solo sequence towards the BatchGenerator, where it continues from its cache.

        A prefilling one becomes a newcomer whose prefill goes on; a decoding one first
        returns the token its last step computed (so no forward pass is in flight), and joins
        with that token as the one left to feed."""
        state = self._running[self._solo_uid]
        if state.solo.prefilling:
            state.solo.step_size = self.prefill_step_size  # no longer alone: others' steps wait on its chunks
            self._solo_uid = None
            self.solo_handoffs += 1
            if self.own_prefill:
                self._prefilling.insert(0, state.uid)  # it came first
            else:
                self._join_batch(state)  # the rest of its prompt with it
            return
        unfed = self._solo_token(state, launch=False)
        self._solo_uid = None
        if state.uid not in self._running:
            return  # that token ended it
        self._flush(state)
        self._store_solo_prompt(state)
        self._join_batch(state, unfed)
        if state.store_prompt:  # its first token is not out yet: the batch stores it later
            state.store_prompt = False
            self._prompt_stores.append(state.uid)
        self.solo_handoffs += 1

    def _join_batch(self, state: _Running, unfed: int | None = None) -> None:
        """Insert a sequence decoding or prefilling on its own into the BatchGenerator."""
        todo, cache, fed = state.solo.handoff(unfed)
        uid = self._batch_insert(state, todo, cache, fed, state.handle.request.max_tokens - state.completion_tokens)
        del self._running[state.uid]
        state.uid, state.solo = uid, None
        self._running[uid] = state

    def _prefill_newcomers(self) -> None:
        """A prompt chunk for each of the first `prefill_batch_size` newcomers (chunks of one
        shape in one forward pass), waited for together; those left with only their last
        token join the batch."""
        group = [self._running[uid] for uid in self._prefilling[: self.prefill_batch_size]]
        fed = feed_chunks_together([state.solo for state in group])
        ready = [state for state, done in zip(group, fed, strict=True) if done]
        for state in group:
            state.solo.wait()
        trim_buffer_cache()
        for state in ready:
            self._prefilling.remove(state.uid)
            self._join_batch(state)

    def _step(self) -> None:
        if self._solo_uid is not None:
            self._solo_step(self._running[self._solo_uid])
            return
        if self._prefilling:
            self._prefill_newcomers()
        # Prompt blocks are stored one step after their prefill ends at the earliest: that step
        # produces the sequence's first token, which goes out before the store (`_first_token_out`).
        due, self._prompt_stores = self._prompt_stores, []
        tic = time.perf_counter()
        prompt_responses, generation_responses = self._bg.next()
        if any(not pr.end_of_prompt for pr in prompt_responses):  # prompts were fed a chunk each
            step = self._bg.prefill_step_size
            self._bg.prefill_step_size = paced_step(step, self.prefill_step_size, step, time.perf_counter() - tic)
        for pr in prompt_responses:
            if pr.end_of_prompt and pr.uid in self._running:
                state = self._running[pr.uid]
                if len(self._running) == 1:  # timed alone: not stretched by others' decode steps
                    self._observe_prefill(state)
                if self.prefix_cache.wants_prompt_blocks(state.prompt_len, state.cached_tokens):
                    self._prompt_stores.append(pr.uid)
        touched: list[_Running] = []
        for r in generation_responses:
            state = self._running.get(r.uid)
            if state is None:
                continue
            self._on_token(state, r)
            if r.uid in self._running:
                touched.append(state)
        self._flush_all(touched)
        for uid in due:
            state = self._running.get(uid)
            if state is None:  # a sequence that already finished was stored whole
                continue
            if not self._first_token_out(state):
                self._prompt_stores.append(uid)
                continue
            self._store_batch_prompt(uid, state)

    def _store_batch_prompt(self, uid: int, state: _Running) -> None:
        cache_and_tokens = self._bg.extract_cache([uid]).get(uid)
        if cache_and_tokens is not None:
            # the prompt alone: its unfinished last block must be keyed by prompt tokens only,
            # so the same prompt finds it again (also after a restart)
            prompt = list(cache_and_tokens[1])[: state.prompt_len]
            if len(prompt) == state.prompt_len or self.prefix_cache.wants_prompt_blocks(len(prompt), state.cached_tokens):
                self._store(prompt, cache_and_tokens[0], final=False)

    def _solo_step(self, state: _Running) -> None:
        """One chunk of the solo prompt, or one token, as `BatchGenerator.next` would do."""
        solo = state.solo
        if solo.prefilling:
            tic, before = time.perf_counter(), len(solo.fed)
            done = solo.prefill()
            seconds = time.perf_counter() - tic
            state.chunk_seconds.append(seconds)
            if not done:
                solo.step_size = paced_step(
                    solo.step_size, self.solo_prefill_step_size, len(solo.fed) - before, seconds, solo.quantum
                )
                return
            self._observe_prefill(state)
            state.store_prompt = self.prefix_cache.wants_prompt_blocks(state.prompt_len, state.cached_tokens)
        # launch the next step unless this token is the last one allowed
        self._solo_token(state, launch=state.completion_tokens + 1 < state.handle.request.max_tokens)
        if state.uid in self._running:
            self._flush(state)
            self._store_solo_prompt(state)  # once the first token is out, as in `_step`

    def _store_solo_prompt(self, state: _Running, now: bool = False) -> None:
        if state.store_prompt and (now or self._first_token_out(state)):
            state.store_prompt = False
            self._store(state.solo.fed[: state.prompt_len], state.solo.cache, final=False)

    @staticmethod
    def _first_token_out(state: _Running) -> bool:
        """The event loop has passed the request's first token on (`_Handle.first_out`), or
        `FIRST_TOKEN_GRACE_S` have passed since it was emitted: its prompt's blocks may be
        stored now."""
        if state.handle.first_out:
            return True
        return state.first_token is not None and time.perf_counter() - state.first_token > FIRST_TOKEN_GRACE_S

    def _observe_prefill(self, state: _Running) -> None:
        computed = state.prompt_len - state.cached_tokens
        if self.prefill_quantum:  # the last chunk's padding was computed too
            computed = -(-(computed - 1) // self.prefill_quantum) * self.prefill_quantum + 1
        seconds = time.perf_counter() - state.prefill_start
        self.prefix_cache.observe_prefill(computed, state.cached_tokens, seconds)
        if state.chunk_seconds and log.isEnabledFor(logging.DEBUG):
            # a slow prefill: evenly slower chunks (the device), one slow chunk (a graph built,
            # pages faulted in) or time between them (the engine loop)?
            chunks = state.chunk_seconds
            log.debug(
                "request=%s prefilled %d tokens after %d in %.3fs: %d chunks %.3fs (slowest #%d %.3fs), between %.3fs",
                state.handle.request.request_id, computed, state.cached_tokens, seconds, len(chunks), sum(chunks),
                max(range(len(chunks)), key=chunks.__getitem__), max(chunks), seconds - sum(chunks),
            )  # fmt: skip

    def _solo_token(self, state: _Running, *, launch: bool) -> int:
        """Take the solo sequence's pending token through the same path as a batch's."""
        solo = state.solo
        token, logprobs = solo.next(launch=launch)
        req = state.handle.request
        reason = None
        if token in self.eos_ids or token in req.stop_token_ids:
            reason = "stop"
        elif state.completion_tokens + 1 >= req.max_tokens:
            reason = "length"
        done = reason is not None
        self._on_token(
            state,
            GenerationBatch.Response(
                uid=state.uid, token=token, logprobs=logprobs, finish_reason=reason,
                prompt_cache=solo.cache if done else None, all_tokens=solo.fed if done else None,
            ),
        )
        return token

    def _store_finished(self) -> None:
        done, self._final_stores = self._final_stores, []
        for tokens, cache in done:
            start = self._store(tokens, cache, final=True)
            if start:
                self._pending_stores.append((tokens, cache, start))
        while len(self._pending_stores) > MAX_PENDING_STORES:  # each holds a whole KV cache
            self._finish_pending_store()

    def _continue_store(self) -> bool:
        """The next piece of the oldest pending store; True while any remain."""
        tokens, cache, start = self._pending_stores.popleft()
        start = self._store(tokens, cache, final=True, start=start)
        if start:
            self._pending_stores.appendleft((tokens, cache, start))
        return bool(self._pending_stores)

    def _finish_pending_store(self, index: int = 0) -> None:
        tokens, cache, start = self._pending_stores[index]
        del self._pending_stores[index]
        while start:
            start = self._store(tokens, cache, final=True, start=start)

    def _finish_stores_for(self, prompt: list[int]) -> None:
        """A prompt that goes on past where a pending store stopped (the next turn of that
        conversation) would find only its first pieces: that store is finished first."""
        for i in reversed(range(len(self._pending_stores))):
            tokens, _, start = self._pending_stores[i]
            if len(prompt) > start and prompt[: start + 1] == tokens[: start + 1]:
                self._finish_pending_store(i)

    def _drop_pending_stores(self, seconds: float) -> None:
        """At shutdown: go on with the pending stores for up to `seconds` (the pool's
        `shutdown` joins this thread from the event loop), then let the rest go."""
        deadline = time.monotonic() + seconds
        while self._pending_stores and DEVICE.lost is None and time.monotonic() < deadline:
            self._continue_store()
        if self._pending_stores:
            log.info("%s: %d finished requests' blocks not stored at shutdown", self.model_id, len(self._pending_stores))
            self._pending_stores.clear()

    def _probe_idle(self) -> None:
        try:
            self.prefix_cache.probe_idle()
        except Exception:  # caching is an optimisation: requests time the tier themselves
            log.exception("timing the prefix cache's slow tiers for %s failed", self.model_id)

    def _write_back(self, idle: bool) -> bool:
        try:
            return self.prefix_cache.write_back(idle)
        except Exception:  # caching is an optimisation
            log.exception("writing prefix-cache blocks of %s back failed", self.model_id)
            return False

    def _store(self, tokens: list[int], cache: list[Any], *, final: bool, start: int = 0) -> int:
        """Caching is an optimisation: its failure is logged, never fails the request. Where
        blocks left for a later call begin (0: none)."""
        try:  # on the engine's stream (`_run`)
            return self.prefix_cache.store(tokens, cache, final=final, start=start) or 0
        except Exception:
            log.exception("storing prefix-cache blocks for %s failed", self.model_id)
            return 0

    def _on_token(self, state: _Running, r: Any) -> None:
        now = time.perf_counter()
        if state.first_token is None:
            state.first_token = now
        state.completion_tokens += 1
        req = state.handle.request
        is_stop_token = r.finish_reason == "stop" and (
            r.token in self.eos_ids or r.token in req.stop_token_ids
        )
        ev = state.pending
        if not is_stop_token:
            state.detokenizer.add_token(r.token)
            ev.token_ids.append(r.token)
            state.generated.append(r.token)
            if req.logprobs is not None:
                ev.logprobs.append(_token_logprob(r.logprobs, r.token, req.logprobs))
        if r.finish_reason is not None:
            state.detokenizer.finalize()
        text, hit = state.stops.feed(state.detokenizer.last_segment, final=r.finish_reason is not None)
        ev.text += text
        if hit:
            if r.finish_reason is None:
                self._drop(state)
            self._finish(state, "stop")
        elif r.finish_reason is not None:
            self._finish(state, r.finish_reason)  # the answer goes out first, then the copy work
            if r.prompt_cache is not None and r.all_tokens is not None:
                self._final_stores.append((list(r.all_tokens), r.prompt_cache))

    def _flush(self, state: _Running) -> None:
        self._flush_all([state])

    def _flush_all(self, states: list[_Running]) -> None:
        """Send what each of `states` has pending, all in one hand-over to the event loop."""
        out = []
        for state in states:
            ev = state.pending
            if ev.text or ev.token_ids or ev.prompt_logprobs is not None:
                state.pending = GenerationEvent()
                out.append((state.handle, ev))
        if out:
            self._emit_many(out)

    def _finish(self, state: _Running, reason: str, error: str | None = None) -> None:
        ev = state.pending
        ev.finish_reason = reason  # type: ignore[assignment]
        ev.error = error
        ev.prompt_tokens = state.prompt_len
        ev.cached_tokens = state.cached_tokens
        ev.completion_tokens = state.completion_tokens
        ev.first_token_time = state.first_token
        ev.stop_string = state.stops.matched
        self._running.pop(state.uid, None)
        if state.uid == self._solo_uid:
            self._solo_uid = None
        self._by_request.pop(state.handle.request.request_id, None)
        self._emit(state.handle, ev)
        self._log_finished(state, reason)

    def _log_finished(self, state: _Running, reason: str) -> None:
        now = time.perf_counter()
        ttft = (state.first_token or now) - state.start
        decode_s = now - (state.first_token or now)
        tps = (state.completion_tokens - 1) / decode_s if decode_s > 0 and state.completion_tokens > 1 else 0.0
        log.info(
            "request=%s model=%s prompt=%d cached=%d completion=%d queue=%.3fs ttft=%.3fs restore=%.3fs "
            "decode=%.1ftok/s finish=%s cache=%s",
            state.handle.request.request_id,
            self.model_id,
            state.prompt_len,
            state.cached_tokens,
            state.completion_tokens,
            state.queued,
            ttft,
            state.prefill_start - state.start,
            tps,
            reason,
            "hit" if state.cached_tokens else "miss",
        )
        if self._on_finished is not None:
            self._on_finished(
                self.model_id,
                {
                    "finish_reason": reason,
                    "prompt_tokens": state.prompt_len,
                    "cached_tokens": state.cached_tokens,
                    "completion_tokens": state.completion_tokens,
                    "queue_s": state.queued,
                    "ttft_s": ttft,
                    "decode_tps": tps,
                },
            )

    def _emit(self, handle: _Handle, event: GenerationEvent) -> None:
        self._emit_many([(handle, event)])

    def _emit_many(self, items: list[tuple[_Handle, GenerationEvent]]) -> None:
        """Queue events for their event loops; each loop is woken once (a step's 32 events:
        one lock, one wake-up, rather than a wake-up racing the rest of the step for the GIL)."""
        wake = []
        with self._outbox_lock:
            for handle, event in items:
                pending = self._outbox.get(handle.loop)
                if pending is None:  # else a `_deliver` for this loop is already scheduled
                    pending = self._outbox[handle.loop] = {}
                    wake.append(handle.loop)
                earlier = pending.get(handle)
                if earlier is None:
                    pending[handle] = event
                else:
                    earlier.merge(event)
        for loop in wake:
            try:
                loop.call_soon_threadsafe(self._deliver, loop)
            except RuntimeError:  # the loop is closed: nobody is left to read these events
                with self._outbox_lock:
                    self._outbox.pop(loop, None)

    def _deliver(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the event loop: hand every waiting event to its request's queue."""
        with self._outbox_lock:
            pending = self._outbox.pop(loop, {})
        for handle, event in pending.items():
            handle.events.put_nowait(event)


def _shared_blocks(a: list[int], b: list[int], block: int) -> int:
    """Tokens of the whole blocks that `a` and `b` begin with alike."""
    n = 0
    while n + block <= min(len(a), len(b)) and a[n : n + block] == b[n : n + block]:
        n += block
    return n


def _mark_first_out(handle: _Handle) -> None:
    handle.first_out = True


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def _token_logprob(logprobs: mx.array, token: int, top: int) -> TokenLogprob:
    chosen = logprobs[token].item()
    alternatives: list[tuple[int, float]] = []
    if top > 0:
        top = min(top, logprobs.shape[-1])
        idx = mx.argpartition(-logprobs, kth=top - 1)[:top]
        vals = logprobs[idx]
        order = mx.argsort(-vals)
        alternatives = [(t, finite_logprob(v)) for t, v in zip(idx[order].tolist(), vals[order].tolist(), strict=True)]
    return TokenLogprob(token, finite_logprob(float(chosen)), alternatives)


__all__ = ["LLMEngine", "EngineError"]
