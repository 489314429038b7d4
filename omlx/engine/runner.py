"""Every MLX call of an engine, on its thread: mlx-lm's `BatchGenerator`, the solo sequence
(solo.py), the engine's own prefill chunks, sampling faults, stores into the prefix cache and
the warm-ups. The scheduler says what to run; the runner runs it and returns `TokenOut`s.
Its broad excepts are the engine's boundary for optional work (caching, warm-ups) and for one
request's admission (docs/design/solo-path.md, prefill-grid.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from omlx.cache.interface import PrefixCacheInterface
from omlx.cache.loader.loading import Loading
from omlx.cache.plan.restore_plan import RestorePlan
from omlx.cache.plan.why import template_rewrote
from omlx.engine import load_warmup, vision_admit
from omlx.engine.buffers import trim_buffer_cache
from omlx.engine.config import EngineConfig
from omlx.engine.device_fault import DEVICE
from omlx.engine.graph_warmup import GraphWarmup
from omlx.engine.kv_budget import KvBudget
from omlx.engine.layer_captures import Captures
from omlx.engine.prefill_pacing import paced_step
from omlx.engine.prompt_logprobs import compute_prompt_logprobs
from omlx.engine.request import GenerationEvent
from omlx.engine.request_state import RequestState, Status, StepOut, StepPlan, TokenOut
from omlx.engine.runner_stores import PromptStores
from omlx.engine.sampling import (
    Guarded,
    build_logits_processors,
    build_sampler,
    clear_faults,
    fault,
    position_at,
    unchanged,
)
from omlx.engine.scheduler import Admission, Admitted
from omlx.engine.solo import (
    PrefillShapes,
    SoloSequence,
    align_cached,
    feed_chunks_together,
    onto_built_shapes,
    plain_kv,
    sdpa_graph_capacity,
)
from omlx.engine.spec_route import SpecRoute
from omlx.engine.speculation import request_aside, speculation_for
from omlx.engine.step_clock import StepClock, TimedForward
from omlx.engine.stop_strings import StopStringMatcher
from omlx.engine.store_queue import StoreQueue

log = logging.getLogger("omlx.engine")


class Runner:
    """Runs what the scheduler planned for one loaded model (engine thread only)."""

    def __init__(
        self,
        loaded: Any,
        config: EngineConfig,
        cache: PrefixCacheInterface,
        budget: KvBudget,
        *,
        quantum: int,
        eos_ids: list[int],
        model_id: str,
        stream: Any,
        on_restored: Callable[[RequestState], None],
    ) -> None:
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        self.draft_model = loaded.draft  # drafts for a request alone (draft_model.py), or None
        self.context_length = loaded.context_length
        self.config, self.cache, self.budget = config, cache, budget
        self.quantum = quantum  # the prefill grid (`EngineConfig.prefill_grid`)
        # windows / recurrent layers: the engine prefills every prompt itself, in chunks ending
        # on the cache's capture points, and snapshots their state (docs/design/cache-kinds.md)
        self.stateful = cache.blocks.captures_states
        self.eos_ids, self.model_id = eos_ids, model_id
        self.stream = stream  # the engine's one MLX stream
        self.on_restored = on_restored  # a read-ahead's background reads are over
        # the prefill chunks' attention shapes this thread has built graphs for (`onto_built_shapes`)
        self.shapes = PrefillShapes(sdpa_graph_capacity()) if config.track_shapes else None
        self.prompts = PromptStores(cache, lambda s: self.rows.extract(s), model_id)  # its stores into the prefix cache
        self.stores = StoreQueue(self.prompts.store)
        self.batch: dict[int, RequestState] = {}  # BatchGenerator uid -> its request
        self.graph_warmup: GraphWarmup | None = None
        self.buffers_dirty = False  # MLX's buffer cache holds what steps left: empty it when idle
        self._failures_seen = 0  # `Guarded.failures` when last looked
        self.clock = StepClock()  # where decode steps spend their time (status: `step_times`)
        self.bg = self.new_batch_generator()
        self.rows = SpecRoute(self, config.draft_max, eos_ids, budget.draft_tokens > 0 and config.batch_speculation, model_id)

    def run(self, plan: StepPlan) -> StepOut:
        """Run one planned step."""
        if plan.solo is not None:
            return StepOut(tokens=self.solo_step(plan.solo))
        joined = self.prefill_newcomers(plan.prefill) if plan.prefill else []
        drafted = self.rows.spec.step() if self.rows.spec else []
        ended, tokens = self.batch_step(plan.single)
        self.rows.route([out.state for out in tokens if out.finish_reason is None])
        return StepOut(drafted + tokens, joined, ended)

    # ----- the batch ---------------------------------------------------------------
    def new_batch_generator(self) -> BatchGenerator:
        c = self.config
        return BatchGenerator(
            TimedForward(lambda: self.model, self.clock),
            stream=self.stream,
            max_tokens=1,
            stop_tokens=[[t] for t in self.eos_ids],
            completion_batch_size=c.max_concurrent,
            prefill_batch_size=c.prefill_batch_size,
            prefill_step_size=c.prefill_step_size,
        )

    def reset(self) -> None:
        """After a failed step: a new BatchGenerator, nothing pending."""
        self.bg = self.new_batch_generator()
        self.batch.clear()
        self.rows.spec.clear()
        self.stores.clear()

    def batch_insert(self, state: RequestState, todo: list[int], cache: Any, fed: list[int], max_tokens: int) -> None:
        if vision_admit.is_vision(self.model):
            cache = vision_admit.batch_cache(self.model, cache, state)
        position_at(state.sampler, state.completion_tokens)  # the next token it samples
        state.uid = self.bg.insert(
            [todo],
            max_tokens=[max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[fed] if fed else None,
            samplers=[state.sampler] if state.sampler is not None else None,
            logits_processors=[state.processors],
            stop_sequences=[state.stop_sequences] if state.stop_sequences is not None else None,
        )[0]
        self.batch[state.uid] = state

    def batch_step(self, single: bool) -> tuple[list[RequestState], list[TokenOut]]:
        """One `BatchGenerator` step (`single`: one sequence runs, so a prefill is timed
        alone); the prompts that ended with blocks worth storing, and the tokens made."""
        tic = time.perf_counter()
        self.clock.begin_batch_step()
        prompt_responses, generation_responses = self.bg.next()
        self.clock.end_batch_step()
        if prompt_responses:
            self.clock.prefilled()
        if any(not pr.end_of_prompt for pr in prompt_responses):  # prompts were fed a chunk each
            step = self.bg.prefill_step_size
            self.bg.prefill_step_size = paced_step(step, self.config.prefill_step_size, step, time.perf_counter() - tic)
        ended = []
        for pr in prompt_responses:
            state = self._live(pr.uid)
            if state is not None and isinstance(pr.progress, tuple):
                state.batch_prefilled = pr.progress[0]
            if pr.end_of_prompt and state is not None:
                self.prompts.capture_row(state, state.prompt_len + state.completion_tokens)  # its last prompt token went in
                if single:  # timed alone: not stretched by others' decode steps
                    self.observe_prefill(state)
                if self.prompts.wants_prompt_blocks(state):
                    ended.append(state)
        outs = []
        self.clock.decoded_rows(len(generation_responses))
        for r in generation_responses:
            state = self._live(r.uid)
            if state is None:
                continue
            states = self.prompts.capture_in_batch(state, r)
            outs.append(TokenOut(state, r.token, r.logprobs, r.finish_reason, r.prompt_cache, r.all_tokens, states))
            if r.finish_reason is not None:
                del self.batch[r.uid]
        return ended, outs

    def _live(self, uid: int) -> RequestState | None:
        state = self.batch.get(uid)
        return state if state is not None and state.status is not Status.FINISHED else None

    def drop(self, state: RequestState) -> None:
        """Stop computing a sequence that ends before its generator says so (a solo one: nothing to do)."""
        self.rows.drop(state)

    def pause(self, state: RequestState) -> None:
        """Take a decoding sequence out of the batch; its cache goes to the prefix cache."""
        found = self.rows.take_out(state)
        if found is not None:
            tokens = found[1]
            states = state.captures.with_end(found[0], len(tokens)) if state.captures is not None else None
            keys = state.request.image_keys
            start = self.prompts.store(tokens, found[0], final=True, boundary_states=states, image_keys=keys)
            self.stores.add_pending(tokens, found[0], start, states, keys)
            self.cache.yield_memory((state.prompt_len + state.completion_tokens) * self.budget.bytes_per_token)

    def sampling_faults(self, states: list[RequestState]) -> list[tuple[RequestState, Exception]]:
        """The requests whose own sampler or logits processors failed since last asked (they
        fell back so the step could go on for the others); their faults are cleared."""
        if Guarded.failures == self._failures_seen:
            return []
        self._failures_seen = Guarded.failures
        failed = [(s, error) for s in states if (error := fault(s.sampler, s.processors)) is not None]
        clear_faults(g for s, _ in failed for g in (s.sampler, *s.processors))
        return failed

    # ----- memory (the scheduler's `Memory`) -----------------------------------------
    def room(self, held_bytes: int) -> int:
        return self.budget.room(mx.get_active_memory(), held_bytes, self.cache.hot_bytes())

    def yield_memory(self, nbytes: int) -> int:
        return self.cache.yield_memory(nbytes)

    def cache_tick(self, idle: bool, *, quiet: bool) -> bool:
        """The prefix cache's background work for this loop (`PrefixCacheInterface.tick`); True
        while more waits. Caching is an optimisation: a failure is logged, never fails a request."""
        try:
            return self.cache.tick(idle, quiet=quiet)
        except Exception:
            log.exception("the prefix cache's background work for %s failed", self.model_id)
            return False

    # ----- admission ---------------------------------------------------------------
    def admit(self, state: RequestState, alone: bool) -> Admitted:
        """Ask for the request's read-ahead the first time, else insert it (`alone`: it runs
        as the solo sequence); a failure fails this request alone."""
        try:
            if state.taken is None:
                state.taken = time.perf_counter()
                state.queued = max(0.0, time.time() - state.request.created)
                self.stores.finish_for(state.request.prompt_tokens)
                asked = time.perf_counter()
                loading = self._read_ahead(state)
                state.admit_s = (asked - state.taken, time.perf_counter() - asked)
                if loading is not None:
                    return Admitted(Admission.RESTORE, loading)
            return self._insert(state, alone)
        except Exception as exc:  # the runner's boundary: this request fails, the engine goes on
            DEVICE.check(exc)
            log.exception("request %s failed at admission", state.id)
            return Admitted(Admission.FAILED, event=GenerationEvent(finish_reason="error", error=str(exc)))

    def _read_ahead(self, state: RequestState) -> Loading | None:
        """The request's restore plan (`match`, once per admission), and its loading when some of it is
        made ready ahead (read from the SSD off this thread, moved from RAM a chunk per loop while
        others run): the request then waits, RESTORING; else None (restored in line at its insert)."""
        req = state.request
        if req.max_tokens <= 0:
            return None
        state.plan = self.cache.match(req.prompt_tokens, grid=self.quantum, image_keys=req.image_keys)
        state.loading = self.cache.load(state.plan, lambda: self.on_restored(state))
        if not state.loading.pending:
            return None
        log.debug("request=%s restores its cached prefix ahead", req.request_id)
        return state.loading

    def advance_restores(
        self, restoring: dict[RequestState, Loading], mover: Loading | None, alone: bool
    ) -> list[tuple[RequestState, Loading | None]]:
        """A piece of each restore's work ahead (`mover` moves blocks on this thread, all of
        them when `alone`); those ready, with None for one that failed."""
        ready: list[tuple[RequestState, Loading | None]] = []
        for state, loading in restoring.items():
            try:
                if self.cache.advance(loading, move=loading is mover, alone=alone):
                    ready.append((state, loading))
            except Exception:  # caching is an optimisation: `cache_for` restores in line instead
                log.exception("restoring the cached prefix of %s ahead failed", state.id)
                ready.append((state, None))
        return ready

    def _insert(self, state: RequestState, alone: bool) -> Admitted:
        if state.status is Status.PAUSED:
            self._resume(state)
            return Admitted(Admission.RESUMED)
        req = state.request
        tokens = req.prompt_tokens
        taken = state.taken or time.perf_counter()
        logprobs_k = req.prompt_logprobs
        prompt_logprobs = None if logprobs_k is None else compute_prompt_logprobs(self.model, tokens, logprobs_k)
        if req.max_tokens <= 0:
            event = GenerationEvent(finish_reason="length", prompt_tokens=len(tokens), prompt_logprobs=prompt_logprobs)
            return Admitted(Admission.ANSWERED, event=event)
        state.plan = state.plan or self.cache.match(tokens, grid=self.quantum, image_keys=req.image_keys)  # no read-ahead
        loading, state.loading = state.loading or self.cache.load(state.plan), None
        step = self.config.solo_prefill_step_size if alone else self.config.prefill_step_size
        looked = time.perf_counter()
        cache, cached = self.cache.cache_for(loading, lambda c, n: self._fit(c, n, state.plan, alone, step))
        state.cache_report = template_rewrote(loading.report, req.rewritten_turns)
        own = self._owns_prefill(len(tokens) - cached, alone) or req.vision is not None
        # a vision prompt's chunks carry the images' features (vision_admit.py)
        cache, vision = vision_admit.solo_parts(self.model, state, cache, cached) if req.vision else (cache, None)
        if log.isEnabledFor(logging.DEBUG):  # where `restore=` goes (other: a read-ahead's wait, prompt logprobs)
            now = time.perf_counter()
            log.debug(
                "request=%s admitted in %.4fs: stores %.4fs, restore planned %.4fs, restored %.4fs, other %.4fs",
                req.request_id, now - taken, *state.admit_s, now - looked, looked - taken - sum(state.admit_s),
            )  # fmt: skip
        self._prepare(state, cached, taken)
        if own:  # decodes alone, or is prefilled here and joins the batch with its last token
            state.solo = SoloSequence(
                self.model, tokens[cached:], cache=cache, cached=tokens[:cached], sampler=state.sampler,
                logits_processors=state.processors, prefill_step_size=step, quantum=self.quantum, shapes=self.shapes,
                captures=state.captures, clock=self.clock, vision=vision,
            )  # fmt: skip
            kind = Admission.SOLO if alone else Admission.PREFILL
            state.spec = speculation_for(state, self.config, self.eos_ids, self.draft_model) if alone else state.spec
        else:
            self.batch_insert(state, tokens[cached:], cache, tokens[:cached], req.max_tokens)
            kind = Admission.BATCH
        state.pending.prompt_logprobs = prompt_logprobs
        return Admitted(kind)

    def _owns_prefill(self, left: int, alone: bool) -> bool:
        """Whether the engine prefills a prompt with `left` tokens to compute (else the BatchGenerator)."""
        return alone or ((self.config.own_prefill or self.stateful) and left > 1)

    def _fit(self, cache: Any, cached: int, plan: RestorePlan, alone: bool, step: int) -> tuple[Any, int]:
        """A restored prefix cut onto the prefill grid, and back to a multiple of the step where that trades
        a graph build for a cheaper recompute (the plan's estimate: docs/design/prefill-grid.md)."""
        tokens = plan.prompt_tokens
        cache, cached = align_cached(cache, cached, self.quantum)
        if self._owns_prefill(tokens - cached, alone):
            cache, cached = onto_built_shapes(cache, cached, tokens, step, self.shapes, self.quantum, plan.recompute_seconds)
        return cache, cached

    def _prepare(self, state: RequestState, cached: int, taken: float) -> None:
        """A request's decoding state, built as it is inserted."""
        req = state.request
        stop_seqs = None
        if req.stop_token_ids:
            stop_seqs = StopSequences([[t] for t in sorted(set(self.eos_ids) | set(req.stop_token_ids))])
        state.detokenizer = self.tokenizer.detokenizer
        state.stops = StopStringMatcher(req.stop)
        state.prompt_len = len(req.prompt_tokens)
        state.cached_tokens = cached
        state.start = taken
        state.prefill_start = time.perf_counter()
        state.sampler = build_sampler(req.sampling)
        state.processors = build_logits_processors(req.sampling)
        if req.constraint is not None:  # last: nothing after it can give a masked token back
            state.processors.append(Guarded(req.constraint.processor(state.prompt_len), unchanged))
        state.stop_sequences = stop_seqs
        state.captures = Captures(self.cache.blocks, state.prompt_len, cached) if self.stateful else None
        state.spec_aside = request_aside(state, self.budget.draft_tokens > 0)

    def _resume(self, state: RequestState) -> None:
        """Insert a paused sequence again: its prompt and the tokens it generated, as far as
        cached, restored; it goes on from its last token."""
        tokens = state.request.prompt_tokens + state.generated
        plan = self.cache.match(tokens, grid=self.quantum, resumed=True, image_keys=state.request.image_keys)
        cache, cached = self.cache.cache_for(self.cache.load(plan))
        cached = min(cached, len(tokens) - 1)
        if cache is not None and plain_kv(cache) and cached < cache[0].offset:  # a stateful one is never trimmed
            for c in cache:
                c.trim(c.offset - cached)
        if self.stateful:  # the rest goes through the BatchGenerator: only decode's boundaries are captured
            state.captures = Captures(self.cache.blocks, len(tokens), len(tokens))
        left = state.request.max_tokens - state.completion_tokens
        self.batch_insert(state, tokens[cached:], cache if cached else None, tokens[:cached], left)

    # ----- sequences outside the batch -----------------------------------------------
    def solo_step(self, state: RequestState) -> list[TokenOut]:
        """One chunk of the solo prompt (no tokens while more remain), or its next tokens: one,
        or a verified draft's (speculation.py)."""
        solo = state.solo
        if solo.prefilling:
            self.clock.prefilled()
            tic, before = time.perf_counter(), len(solo.fed)
            done = solo.prefill()
            seconds = time.perf_counter() - tic
            state.chunk_seconds.append(seconds)
            if not done:
                solo.step_size = paced_step(
                    solo.step_size, self.config.solo_prefill_step_size, len(solo.fed) - before, seconds, solo.quantum
                )
                return []
            self.observe_prefill(state)
            state.store_prompt = self.prompts.wants_prompt_blocks(state)
        left = state.request.max_tokens - state.completion_tokens
        if state.spec is not None and (outs := state.spec.outs(state, left, self._solo_out)) is not None:
            return outs
        return [self.solo_token(state, launch=left > 1)]  # no next step after the last token allowed

    def solo_token(self, state: RequestState, *, launch: bool) -> TokenOut:
        """The solo sequence's pending token, as a batch's would come."""
        token, logprobs = state.solo.next(launch=launch)
        return self._solo_out(state, token, logprobs, 0, lambda: None)

    def _solo_out(self, state: RequestState, token: int, logprobs: Any, ahead: int, cut: Callable[[], None]) -> TokenOut:
        """`token`, `ahead` after the last one emitted, with its finish if it ends the request (then `cut`)."""
        solo, req = state.solo, state.request
        reason = None
        if token in self.eos_ids or token in req.stop_token_ids:
            reason = "stop"
        elif state.completion_tokens + ahead + 1 >= req.max_tokens:
            reason = "length"
        if reason is None:
            return TokenOut(state, token, logprobs)
        cut()
        if state.store_prompt:  # its prompt's own blocks (a tail keyed by the prompt alone), stored after its end
            state.store_prompt = False
            fed = solo.fed[: self.prompts.prompt_stored(state)]
            self.stores.add(fed, solo.cache, self.prompts.states(state), state.request.image_keys)
        states = state.captures.with_end(solo.cache, len(solo.fed)) if state.captures is not None else None
        return TokenOut(state, token, logprobs, reason, prompt_cache=solo.cache, all_tokens=solo.fed, boundary_states=states)

    def leave_solo(self, state: RequestState) -> None:
        """A solo prefill is no longer alone: others' steps wait on its chunks."""
        state.solo.step_size = self.config.prefill_step_size

    def join_batch(self, state: RequestState, unfed: int | None = None) -> None:
        """Insert a sequence decoding or prefilling on its own into the batch (spec_route.py)."""
        todo, cache, fed = state.solo.handoff(unfed)
        state.solo = None
        if not self.rows.join(state, todo, cache, fed, state.spec.lookup if state.spec is not None else None):
            self.batch_insert(state, todo, cache, fed, state.request.max_tokens - state.completion_tokens)

    def prefill_newcomers(self, group: list[RequestState]) -> list[RequestState]:
        """A prompt chunk for each of `group` (chunks of one shape in one forward pass), waited
        for together and paced so that the step takes about `TARGET_CHUNK_S` (a cancel or the
        batch's next token waits for one step); those left with only their last token join the
        batch and are returned."""
        self.clock.prefilled()
        tic, before = time.perf_counter(), [len(state.solo.fed) for state in group]
        fed = feed_chunks_together([state.solo for state in group])
        ready = [state for state, done in zip(group, fed, strict=True) if done]
        for state in group:
            state.solo.wait()
        seconds = time.perf_counter() - tic
        for state, was in zip(group, before, strict=True):  # the step's chunks together take about the target
            solo = state.solo
            solo.step_size = paced_step(solo.step_size, self.config.prefill_step_size, len(solo.fed) - was, seconds, solo.quantum)
        trim_buffer_cache()
        for state in ready:
            self.join_batch(state)
        return ready

    def observe_prefill(self, state: RequestState) -> None:
        """Tell the prefix cache how long the request's prefill took (its restore model)."""
        computed = state.prompt_len - state.cached_tokens
        if self.quantum:  # the last chunk's padding was computed too
            computed = -(-(computed - 1) // self.quantum) * self.quantum + 1
        seconds = time.perf_counter() - state.prefill_start
        self.cache.observe_prefill(computed, state.cached_tokens, seconds)
        if state.chunk_seconds and log.isEnabledFor(logging.DEBUG):
            # a slow prefill: evenly slower chunks (the device), one slow chunk (a graph built,
            # pages faulted in) or time between them (the engine loop)?
            chunks = state.chunk_seconds
            log.debug(
                "request=%s prefilled %d tokens after %d in %.3fs: %d chunks %.3fs (slowest #%d %.3fs), between %.3fs",
                state.id, computed, state.cached_tokens, seconds, len(chunks), sum(chunks),
                max(range(len(chunks)), key=chunks.__getitem__), max(chunks), seconds - sum(chunks),
            )  # fmt: skip

    # ----- warm-ups and buffers ------------------------------------------------------
    def warm_up(self, solo: bool) -> None:
        """A few tokens through the paths requests take (load_warmup.py); optional."""
        tic = time.perf_counter()
        try:
            load_warmup.warm_up(
                self.model, self.tokenizer, self.bg, self.eos_ids, own_prefill=self.config.own_prefill, solo=solo
            )
        except Exception:  # a warm-up is an optimisation; the model still serves
            log.warning("warm-up of %s failed", self.model_id, exc_info=True)
            self.bg.close()
            self.bg = self.new_batch_generator()
        mx.clear_cache()
        log.info("warmed up %s in %.2fs", self.model_id, time.perf_counter() - tic)

    def start_graph_warmup(self) -> dict[str, Any] | None:
        """Make the idle attention-graph warm-up where one is asked for; its progress."""
        depth = min(self.config.graph_warmup_tokens, self.context_length or self.config.graph_warmup_tokens)
        self.graph_warmup = GraphWarmup.for_model(
            self.model, self.tokenizer, self.eos_ids, depth, self.config.solo_prefill_step_size, self.shapes
        )
        return self.graph_warmup.progress() if self.graph_warmup is not None else None

    def warm_graphs(self, idle: bool) -> dict[str, Any]:
        """One chunk of the graph warm-up when the process is idle, else pause it; its progress."""
        warmup = self.graph_warmup
        assert warmup is not None
        if not idle:
            warmup.pause()
        else:
            try:
                warmup.feed()
                trim_buffer_cache()  # its cache grows by concatenation, as a prompt's does
            except Exception as exc:  # optional work: the model still serves
                if DEVICE.check(exc):
                    raise
                log.warning("attention-graph warm-up of %s failed", self.model_id, exc_info=True)
                warmup.close(f"failed: {exc}")
        progress = warmup.progress()
        if warmup.over:
            self.graph_warmup = None
            self.buffers_dirty = True  # what it left in MLX's buffer cache goes when idle
            warmup.log_end(self.model_id)
        return progress

    def clear_buffers_if_dirty(self, others_busy: bool) -> None:
        """Idle: empty MLX's buffer cache of what steps left, or of what other threads freed
        into it where asked (buffers.py says why), unless another engine is busy."""
        foreign = self.config.idle_empties_cache and self.graph_warmup is None and mx.get_cache_memory() > 0 and not others_busy
        if self.buffers_dirty or foreign:
            self.buffers_dirty = False
            mx.clear_cache()

    def stop_graph_warmup(self) -> None:
        if self.graph_warmup is not None:
            self.graph_warmup.close("the engine stopped")

