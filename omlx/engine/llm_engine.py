"""One LLM engine per loaded model: a thread that owns every MLX call for that model.

The asyncio side calls `generate()`, which hands the request to the engine thread through
the bridge (bridge.py) and yields its `GenerationEvent`s. Each loop of the thread reads the
inbox, then schedule (scheduler.py: admission, hand-off, pauses) -> run (runner.py: every
MLX call) -> update (tokens into events and stores) -> cache tick (the prefix cache's
background work).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import mlx.core as mx

from omlx.cache.block.kv_layout import kv_bytes_per_token
from omlx.cache.interface import NoCache, PrefixCacheInterface
from omlx.engine import activity
from omlx.engine.bridge import Bridge
from omlx.engine.config import EngineConfig
from omlx.engine.constraints import ConstraintError
from omlx.engine.device_fault import DEVICE, DeviceLostError
from omlx.engine.kv_budget import KvBudget
from omlx.engine.output import Output
from omlx.engine.prompt_logprobs import token_logprob
from omlx.engine.request import GenerationEvent, GenerationRequest
from omlx.engine.request_state import RequestState, Status, Update
from omlx.engine.runner import Runner
from omlx.engine.scheduler import Places, Scheduler
from omlx.engine.speculation import model_speculates
from omlx.engine.step_clock import PERF
from omlx.errors import EngineError
from omlx.models.loader import LoadedLLM
from omlx.pool.memory import load_measured, memory_limit_total

log = logging.getLogger("omlx.engine")
# At a stop, finished requests' blocks are still stored for up to STOP_STORES_S, and the SSD
# writer is given STOP_WRITES_S to finish its queue (what is left is dropped, never half
# written): with the server's own grace, a SIGTERM ends the process within 15 s.
STOP_STORES_S = 2.0
STOP_WRITES_S = 5.0


class LLMEngine:
    """The engine of one model: `generate` and friends on the event loop, the rest on its thread."""

    def __init__(
        self,
        model_id: str,
        loader: Callable[[], LoadedLLM],
        *,
        prefix_cache_factory: Callable[[LoadedLLM], PrefixCacheInterface] | None = None,
        on_finished: Callable[[str, dict[str, Any]], None] | None = None,
        max_kv_memory: int | None = None,
        **settings: Any,
    ):
        """`settings` are `EngineConfig.resolve`'s (max_concurrent, prefill_step_size, solo, ...)."""
        self.model_id = model_id
        self.config = EngineConfig.resolve(**settings)
        self._loader = loader
        self._prefix_cache_factory = prefix_cache_factory
        self._max_kv_memory = max_kv_memory
        self.loaded: LoadedLLM | None = None
        self._model: Any = None
        self.tokenizer: Any = None
        self.context_length = 0
        self.eos_ids: list[int] = []
        self.model_vocab_size = 0
        self.prefix_cache: PrefixCacheInterface = NoCache()
        self.prefill_quantum = self.config.prefill_grid(self.prefix_cache.blocks.block_size)
        self.memory_bytes = 0  # measured on the engine thread after loading
        self.kv_budget: KvBudget | None = None  # measured at load (`kv_bytes_per_token`)
        # the longest sequence this device's memory could ever hold (None: not limited); routes
        # refuse longer prompts and clamp max_tokens to it
        self.max_sequence_tokens: int | None = None
        self.graph_warmup_progress: dict[str, Any] | None = None  # published for /api/status
        self.leases = 0  # held by routes between acquire and release (event loop only)
        self.kind = "llm"
        self.active_count = 0  # published by the engine thread for observers
        self.waiting_count = 0
        self.bridge = Bridge()
        self.output = Output(model_id, self.bridge.emit_many, token_logprob, on_finished)
        self.scheduler = Scheduler(self.config.max_concurrent, self.output, solo=self.config.solo)
        self.places = Places(model_id, self.config.max_concurrent, self.config.max_waiting, DEVICE.raise_if_lost)
        self._live: dict[str, RequestState] = {}  # submitted and not finished (event loop only)
        self.runner: Runner | None = None  # made on the engine thread at load
        self._writes_held = False  # the SSD writer waits while a lone prompt is prefilled
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._stop = threading.Event()
        self._stream: mx.Stream | None = None  # created on the engine thread
        activity.register(self)
        self._thread = threading.Thread(target=self._run, name=f"engine:{model_id}", daemon=True)
        self._thread.start()

    # ----- settings, as observers read them -------------------------------------------
    @property
    def model(self) -> Any:
        return self._model

    @model.setter
    def model(self, model: Any) -> None:
        """The model every later step runs (the runner's too)."""
        self._model = model
        if self.runner is not None:
            self.runner.model = model

    @property
    def max_concurrent(self) -> int:
        return self.config.max_concurrent

    @property
    def solo_prefill_step_size(self) -> int:
        return self.config.solo_prefill_step_size

    @property
    def graph_warmup_tokens(self) -> int:
        return self.config.graph_warmup_tokens

    @property
    def paused_for_memory(self) -> int:
        """Sequences paused so far because the running ones outgrew memory."""
        return self.scheduler.paused_for_memory

    @property
    def solo_handoffs(self) -> int:
        """Solo sequences moved into the BatchGenerator so far."""
        return self.scheduler.handoffs

    @property
    def busy(self) -> bool:
        """Requests submitted or leased and not finished: such an engine is never evicted."""
        return self.places.outstanding > 0 or self.leases > 0

    # ----- asyncio side -------------------------------------------------------------
    async def wait_ready(self) -> None:
        """Wait for the model to finish loading on the engine thread; re-raise its failure."""
        if not self._ready.is_set():
            await asyncio.to_thread(self._ready.wait)
        if self._load_error is not None:
            raise self._load_error

    def reserve(self, requests: list[GenerationRequest]) -> None:
        """Claim a place (running or waiting) for each request before its response starts, or
        raise `OverloadedError` (429) for all of them. `generate` then takes the place;
        `release` gives back what was not taken."""
        self.places.reserve(requests)

    def release(self, requests: list[GenerationRequest]) -> None:
        """The caller is done with `requests`: places not taken go back, and any request still
        running is cancelled (its client left)."""
        for r in requests:
            self.places.give_back(r)
            state = self._live.get(r.request_id)
            if state is not None and not state.done:
                state.done = True
                self.bridge.put("cancel", r.request_id)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Submit a request and stream its events; closing the iterator cancels it."""
        self.places.take(request)
        state = RequestState(request, loop=asyncio.get_running_loop(), events=asyncio.Queue())
        self._live[request.request_id] = state
        self.bridge.put("submit", state)
        events = self.bridge.stream(state)
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()
            self.places.finished()
            self._live.pop(request.request_id, None)
            if not state.done:
                state.done = True
                self.bridge.put("cancel", request.request_id)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the engine thread between steps (MLX work such as tokenize-free scoring)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self.bridge.put("call", fn, loop, future)
        return await future

    def requests_view(self) -> list[dict[str, Any]]:
        """Each request submitted and not finished: its state and prefill position (event loop)."""
        now = PERF()
        return [state.view(now) for state in list(self._live.values())]

    def stats(self) -> dict[str, Any]:
        return {"active": self.active_count, "waiting": self.waiting_count}

    @property
    def step_times(self) -> dict[str, Any] | None:
        """Where decode steps spent their time so far (`StepClock.snapshot`; from the event loop)."""
        return self.runner.clock.snapshot() if self.runner is not None else None

    def stop_generating(self, reason: str) -> None:
        """From any thread: fail every request held or arriving from now on with `reason`
        (the server is going down; their clients get an answer, not a cut connection)."""
        self.places.stopping = reason
        self.bridge.put("fail_all", reason)

    def request_stop(self) -> None:
        """Ask the engine thread to stop after its current step (`shutdown` waits for it)."""
        self._stop.set()
        self.bridge.put("stop")

    def shutdown(self, timeout: float = 10.0) -> None:
        self.request_stop()
        self._thread.join(timeout)

    # ----- engine thread: load and stop ----------------------------------------------
    def _load(self) -> bool:
        try:
            loaded, self.memory_bytes = load_measured(self._loader)
            self.loaded, self.model, self.tokenizer = loaded, loaded.model, loaded.tokenizer
            self.context_length = loaded.context_length
            self.eos_ids = self.output.eos_ids = sorted(set(loaded.tokenizer.eos_token_ids or []))
            args = getattr(loaded.model, "args", None)
            self.model_vocab_size = getattr(args, "vocab_size", None) or len(loaded.tokenizer)
            if self._prefix_cache_factory is not None:
                self.prefix_cache = self._prefix_cache_factory(loaded)
                # a stateful model's restored prefix is never cut to a grid (cache-kinds.md)
                blocks = self.prefix_cache.blocks
                self.prefill_quantum = 0 if blocks.captures_states else self.config.prefill_grid(blocks.block_size)
            # One stream per engine, for everything it computes (steps, restores, stores,
            # scoring): mlx-lm's default `generation_stream` is shared by every BatchGenerator in
            # the process, and mixing streams within an engine made MLX's CUDA backend hang.
            self._stream = mx.new_stream(mx.default_device())
            drafts = self.config.draft_max if self.config.speculation and model_speculates(self.model, self.model_id) else 0
            self.kv_budget = KvBudget(kv_bytes_per_token(self.model), memory_limit_total(), self._max_kv_memory, drafts)
            self.runner = Runner(
                loaded, self.config, self.prefix_cache, self.kv_budget, quantum=self.prefill_quantum,
                eos_ids=self.eos_ids, model_id=self.model_id, stream=self._stream,
                on_restored=lambda state: self.bridge.put("restored", state),
            )  # fmt: skip
            with mx.stream(self._stream):
                self.runner.warm_up(self.config.solo)
            self.graph_warmup_progress = self.runner.start_graph_warmup()
            self.max_sequence_tokens = self.kv_budget.most_tokens(self.memory_bytes)
            sched = self.scheduler
            sched.budget, sched.memory, sched.block_size = self.kv_budget, self.runner, self.prefix_cache.blocks.block_size
            return True
        except BaseException as exc:  # the thread's edge: reported to every waiter by wait_ready()
            DEVICE.check(exc)
            log.exception("loading %s failed", self.model_id)
            self._load_error = exc
            return False
        finally:
            self._ready.set()

    def _run(self) -> None:
        try:
            self._load_and_loop()
        finally:
            activity.unregister(self)

    def _load_and_loop(self) -> None:
        if not self._load():
            self._close_prefix_cache(timeout=0.0)  # it may have been made before the failure
            return
        runner = self.runner
        runner.clock.engine_tid = threading.get_native_id()
        try:
            with mx.stream(self._stream):
                try:
                    self._loop()
                finally:  # stopping: what waits for the SSD goes now (shutdown() joins for 10 s)
                    runner.stop_graph_warmup()
                    self._hold_writes(False)
                    runner.stores.drain(STOP_STORES_S, lambda: DEVICE.lost is None, self.model_id)
                    self._close_prefix_cache(timeout=STOP_WRITES_S)
        finally:
            runner.bg.close()

    def _close_prefix_cache(self, timeout: float) -> None:
        try:
            self.prefix_cache.close(timeout=timeout)
        except Exception:  # the thread's edge, at its end
            log.exception("closing the prefix cache of %s failed", self.model_id)

    # ----- engine thread: the loop -----------------------------------------------------
    def _loop(self) -> None:
        unwritten = False  # stored blocks wait for the SSD and the writer takes more: go on soon
        while not self._stop.is_set():
            if DEVICE.lost is not None:  # nothing can run here any more: answer whatever comes
                self._answer_while_lost()
                continue
            try:
                unwritten = self._loop_once(unwritten)
            except Exception as exc:  # an engine fault fails the requests in flight, not the server
                self._after_fault(exc)
            self.active_count = len(self.scheduler.running)
            self.waiting_count = len(self.scheduler.waiting) + len(self.scheduler.restoring)

    def _loop_once(self, unwritten: bool) -> bool:
        """Inbox, schedule, run, update, cache tick; whether stored blocks still wait to be written."""
        sched, runner = self.scheduler, self.runner
        runner.clock.start_loop()
        made = 0
        idle = sched.idle
        # the graph warm-up goes on only while no engine of the process has requests
        warming = runner.graph_warmup is not None and idle and not sched.restoring and not activity.others_busy(self)
        self._drain_inbox(block=idle and not unwritten and not sched.moving_from_ram() and not warming)
        self._admit()
        self._hold_writes(sched.prefilling_alone())
        if runner.graph_warmup is not None:
            self.graph_warmup_progress = runner.warm_graphs(idle=sched.alone and not activity.others_busy(self))
        if sched.running:
            made = self._step()
            runner.buffers_dirty = True
            self._pause_if_outgrown()
            self._fail_sampling_faults()
        tic = PERF()
        runner.stores.store_finished()
        # idle, and no request waiting for this thread to move its cached prefix in from
        # RAM: that restore is all of its TTFT, and the copies out would lengthen it
        idle = sched.idle and not sched.moving_from_ram()
        if not sched.prefilling_alone():  # else its TTFT would carry the copies
            unwritten = self._cache_tick(idle)
        runner.clock.add("cache", PERF() - tic)
        runner.clock.end_loop(made)
        return unwritten

    def _cache_tick(self, idle: bool) -> bool:
        """The prefix cache's background work for this loop (its `tick`: write-back), the pending
        stores' next piece and, `idle` with nothing left to write, MLX's buffers emptied before
        the tick's idle part (its timings must not pay for freed buffers). True while writes wait."""
        runner = self.runner
        unwritten = runner.cache_tick(idle, quiet=False)
        if idle and runner.stores.pending:
            unwritten = runner.stores.continue_store() or unwritten
        if idle and not unwritten:
            others_busy = activity.others_busy(self)
            runner.clear_buffers_if_dirty(others_busy)  # idle: nobody waits on it now
            if not others_busy:
                unwritten = runner.cache_tick(True, quiet=True)
        return unwritten

    def _answer_while_lost(self) -> None:
        """The device is lost: fail what is held, then answer whatever comes."""
        error = DeviceLostError(DEVICE.lost).message
        for state in list(self.scheduler.running.values()):  # lost on another engine's thread
            self.scheduler.finish(state, "error", error=error)
        self._fail_queued(error)
        self._hold_writes(False)
        self.active_count = self.waiting_count = 0
        self._drain_inbox(block=True)

    def _after_fault(self, exc: Exception) -> None:
        """A step failed: the requests in it fail; the engine goes on with a new batch (or,
        the device lost, answers the rest from the next loop)."""
        sched = self.scheduler
        lost = DEVICE.check(exc)
        log.exception("engine %s failed a step; failing %d requests", self.model_id, len(sched.running))
        for state in list(sched.running.values()):
            sched.finish(state, "error", error=f"engine failure: {exc}")
        self._hold_writes(False)
        if lost:  # so would every later step: the next loop answers the queued ones
            return
        self.runner.reset()
        sched.after_fault()

    def _drain_inbox(self, block: bool) -> None:
        for message in self.bridge.messages(block):
            kind = message[0]
            if kind == "submit":
                self.scheduler.submit(message[1])
            elif kind == "cancel":
                self._cancel(message[1])
            elif kind == "fail_all":
                self._fail_all(message[1])
            elif kind == "call":
                Bridge.answer(*message[1:])
            # "restored": a read-ahead is over, `_admit` looks at it now; "stop": `_loop` ends

    def _hold_writes(self, on: bool) -> None:
        if on != self._writes_held:
            self._writes_held = on
            self.prefix_cache.hold_writes(on)

    # ----- engine thread: schedule, run, update ------------------------------------------
    def _admit(self) -> None:
        sched, runner = self.scheduler, self.runner
        if sched.restoring:
            sched.restored(runner.advance_restores(sched.restoring, sched.mover(), alone=sched.idle))
        if sched.hand_off_due():
            self._hand_off()  # a second request: the solo one joins the batch first
        for state in sched.admissions():
            sched.admitted(state, runner.admit(state, alone=sched.solo_enabled and sched.idle))

    def _hand_off(self) -> None:
        """Move the solo sequence towards the BatchGenerator: a prefilling one becomes a newcomer
        whose prefill goes on; a decoding one returns the token its last step computed (no
        forward pass in flight) and joins with that token left to feed (solo-path.md)."""
        sched, runner = self.scheduler, self.runner
        state = sched.leave_solo()
        if state.solo.prefilling:
            runner.leave_solo(state)
            if self.config.own_prefill or runner.stateful:  # a stateful prompt's chunks end on its capture points
                sched.prefill_first(state)
            else:
                runner.join_batch(state)  # the rest of its prompt with it
                sched.joined_batch(state)
            return
        out = runner.solo_token(state, launch=False)
        self._apply(sched.update([out]))
        if state.status is Status.FINISHED:
            return  # that token ended it
        runner.prompts.store_solo_prompt(state)
        runner.join_batch(state, out.token)
        sched.joined_batch(state)

    def _step(self) -> int:
        """Schedule, run, update: one step of the running sequences; the tokens it made."""
        plan = self.scheduler.schedule(self.config.prefill_batch_size)
        out = self.runner.run(plan)
        result = self.scheduler.update_step(plan, out)
        self._apply(result)
        tic = PERF()
        if plan.solo is not None and plan.solo.status is not Status.FINISHED and self.scheduler.waiting:
            # once its first token is out, for a request that waits (it may share that prompt); else the
            # request's end stores it, not its next tokens (docs/design/write-back.md, "Prompt stores")
            self.runner.prompts.store_solo_prompt(plan.solo)
        for state in result.prompt_stores:
            self.runner.prompts.store_batch_prompt(state)
        self.runner.clock.add("cache", PERF() - tic)
        return len(out.tokens)

    def _apply(self, result: Update) -> None:
        """What an update leaves: sequences to stop, finished ones to store."""
        for state in result.dropped:
            self.runner.drop(state)
        for tokens, cache, states, image_keys in result.stores:
            self.runner.stores.add(tokens, cache, states, image_keys)

    def _pause_if_outgrown(self) -> None:
        """When the decoding sequences have outgrown the room, the newest is paused: its cache
        goes to the prefix cache's tiers and it waits first in line, to go on from there."""
        found = self.scheduler.outgrown()
        if found is None:
            return
        state, short = found
        self.runner.pause(state)
        self.scheduler.paused(state)
        log.info("request=%s paused: running sequences outgrew KV memory (%d bytes short)", state.id, short)

    def _fail_sampling_faults(self) -> None:
        """Fail, alone, the requests whose own sampler or logits processors failed in this step."""
        for state, error in self.runner.sampling_faults(list(self.scheduler.running.values())):
            log.warning("request=%s: sampling failed: %s", state.id, error)
            self.runner.drop(state)
            if isinstance(error, ConstraintError):  # its own grammar: the caller's to fix
                state.pending.error_type = error.error_type
                message = f"structured output failed: {error}"
            else:
                message = f"sampling failed: {error}"
            self.scheduler.finish(state, "error", error=message)

    def _cancel(self, request_id: str) -> None:
        sched = self.scheduler
        state = sched.cancel(request_id)
        if state is None:
            return
        self.runner.prompts.store_computed_prompt(state, due=state in sched.prompt_stores)
        self.runner.drop(state)
        sched.forget(state)
        self.output.log_finished(state, "cancelled")

    def _fail_all(self, error: str) -> None:
        """Answer every request held with `error`; running ones stop computing now."""
        for state in list(self.scheduler.running.values()):
            self.runner.drop(state)
            self.scheduler.finish(state, "error", error=error)
        self._fail_queued(error)

    def _fail_queued(self, error: str) -> None:
        """Answer every request not yet running with `error`."""
        queued = self.scheduler.take_queued()
        self.bridge.emit_many([(state, GenerationEvent(finish_reason="error", error=error)) for state in queued])


__all__ = ["LLMEngine", "EngineError"]
