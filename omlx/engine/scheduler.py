"""Which requests wait, restore, prefill, decode, pause or get stored, and in what order.

Pure Python (no MLX), so it is tested with fake runner outputs and no model. The engine
thread asks it whom to admit (`admissions`), tells it what the runner made of each
(`admitted`), feeds it the tokens the runner produced (`update`) and asks whom to pause when
the decoding sequences outgrow memory (`outgrown`). `Places` is the event loop's side:
the places claimed before a response starts (docs/design/memory-admission.md).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from omlx.cache.loader.loading import Loading
from omlx.engine.kv_budget import KvBudget
from omlx.engine.output import Output
from omlx.engine.request import GenerationEvent, GenerationRequest
from omlx.engine.request_state import RequestState, Status, StepOut, StepPlan, TokenOut, Update
from omlx.errors import OverloadedError, ServiceUnavailableError


class Memory(Protocol):
    """The device's side of memory admission (the engine's: MLX and the prefix cache)."""

    def room(self, held_bytes: int) -> int:
        """Bytes the engine's sequences may hold now, `held_bytes` of which they hold."""
        ...

    def yield_memory(self, nbytes: int) -> int:
        """Free at least `nbytes` of the hot tier if it can; the bytes freed."""
        ...


class Admission(Enum):
    """What the runner made of a request the scheduler admitted."""

    RESTORE = "restore"  # its cached prefix is being made ready ahead (`Admitted.loading`)
    SOLO = "solo"  # runs alone outside the BatchGenerator
    PREFILL = "prefill"  # prefilled by the engine, then joins the batch
    BATCH = "batch"  # inserted into the BatchGenerator
    RESUMED = "resumed"  # a paused sequence goes on in the batch
    ANSWERED = "answered"  # nothing to generate: `Admitted.event` is its answer
    FAILED = "failed"  # `Admitted.event` carries the error


@dataclass
class Admitted:
    kind: Admission
    loading: Loading | None = None
    event: GenerationEvent | None = None


class Scheduler:
    """The engine's queues and its decisions on them (engine thread only)."""

    def __init__(self, max_concurrent: int, output: Output, *, solo: bool = True) -> None:
        self.max_concurrent = max_concurrent
        self.output = output
        self.solo_enabled = solo  # a lone request decodes outside the BatchGenerator
        self.budget: KvBudget | None = None  # set at load
        self.memory: Memory | None = None
        self.block_size = 0  # the prefix cache's (0: no in-flight prefix sharing)
        self.by_id: dict[str, RequestState] = {}  # every request held and not finished
        self.waiting: deque[RequestState] = deque()
        self.restoring: dict[RequestState, Loading] = {}  # RESTORING -> its plan being carried out, until ready
        self.running: dict[int, RequestState] = {}  # by `seq`, in admission order
        self.solo: RequestState | None = None  # the one running alone, if any
        self.prefilling: list[RequestState] = []  # newcomers the engine prefills, in arrival order
        self.prompt_stores: list[RequestState] = []  # batch prompts whose blocks are stored next step
        self.paused_for_memory = 0  # sequences paused so far because the running ones outgrew memory
        self.handoffs = 0  # solo sequences moved towards the batch so far

    # ----- arrivals and departures --------------------------------------------------
    def submit(self, state: RequestState) -> None:
        state.status = Status.WAITING
        self.waiting.append(state)
        self.by_id[state.id] = state

    def cancel(self, request_id: str) -> RequestState | None:
        """Take a request out wherever it is; a running one is returned for the caller to
        store what it computed, stop its computation and `forget` it."""
        state = self.by_id.pop(request_id, None)
        if state is None:
            return None
        if state in self.waiting:
            self.waiting.remove(state)
        elif self.restoring.pop(state, None) is None and self.running.get(state.seq) is state:
            return state
        _ended(state)
        return None

    def forget(self, state: RequestState) -> None:
        """`state` has finished or was cancelled: it leaves every queue, and lets go of what
        its computation held (the asyncio side may hold the state a while longer)."""
        _ended(state)
        if self.running.get(state.seq) is state:
            del self.running[state.seq]
        if self.by_id.get(state.id) is state:
            del self.by_id[state.id]
        if self.solo is state:
            self.solo = None
        if state in self.prefilling:
            self.prefilling.remove(state)
        if state in self.prompt_stores:
            self.prompt_stores.remove(state)

    def finish(self, state: RequestState, reason: str, error: str | None = None) -> None:
        self.forget(state)
        self.output.finish(state, reason, error)

    def take_queued(self) -> list[RequestState]:
        """Every request not running yet, out of the queues (to be failed)."""
        queued = [*self.waiting, *self.restoring]
        self.waiting.clear()
        self.restoring.clear()
        for state in queued:
            self.by_id.pop(state.id, None)
            _ended(state)
        return queued

    def unfinished(self) -> list[RequestState]:
        """Every request held and not finished: running first, then in line."""
        return [*self.running.values(), *self.waiting, *self.restoring]

    def after_fault(self) -> None:
        """A failed step took the BatchGenerator and the running sequences with it."""
        self.prompt_stores = []
        self.solo = None
        self.prefilling = []

    # ----- what the loop looks at ----------------------------------------------------
    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    @property
    def alone(self) -> bool:
        """Nothing else runs, waits or restores."""
        return self.idle and not self.restoring

    def prefilling_alone(self) -> bool:
        """A lone request's prompt is being fed: its prefill is all of its TTFT, so background
        copies and SSD writes wait (docs/design/solo-path.md, "Writes held")."""
        state = self.solo
        return state is not None and state.solo is not None and state.solo.prefilling

    def moving_from_ram(self) -> bool:
        """A restore moves a cached prefix in from RAM on the engine thread (a chunk a loop)."""
        return any(loading.needs_engine for loading in self.restoring.values())

    def mover(self) -> Loading | None:
        """The one restore that moves blocks on the engine thread this loop, if any."""
        return next((loading for loading in self.restoring.values() if loading.needs_engine), None)

    def hand_off_due(self) -> bool:
        """A second request arrived while one runs alone: that one joins the batch first."""
        return bool(self.waiting) and self.solo is not None and self.max_concurrent > 1

    # ----- the solo -> batch hand-off ---------------------------------------------------
    def leave_solo(self) -> RequestState:
        """The solo sequence gives up running alone (`hand_off_due`); it stays running."""
        state, self.solo = self.solo, None
        assert state is not None
        return state

    def prefill_first(self, state: RequestState) -> None:
        """A solo prompt handed off mid-prefill: first among the newcomers the engine prefills."""
        self.prefilling.insert(0, state)
        self.handoffs += 1

    def joined_batch(self, state: RequestState) -> None:
        """A sequence left solo joined the batch: a prompt store still waiting for its first
        token to go out goes with the batch's prompt stores."""
        if state.store_prompt:
            state.store_prompt = False
            self.prompt_stores.append(state)
        self.handoffs += 1

    # ----- admission -------------------------------------------------------------------
    def admissions(self) -> Iterator[RequestState]:
        """The requests to admit now, first come first; each is `admitted` before the next is
        chosen. One that shares a running prefill waits behind it; one whose memory does not
        fit stops the line (it goes first once memory frees up)."""
        deferred: list[RequestState] = []
        try:
            while self.waiting and len(self.running) + len(self.restoring) < self.max_concurrent:
                state = self.waiting.popleft()
                if self.shares_a_prefill(state):
                    deferred.append(state)
                    continue
                if not self.fits(state):
                    self.waiting.appendleft(state)
                    break
                yield state
        finally:
            self.waiting.extendleft(reversed(deferred))

    def admitted(self, state: RequestState, result: Admitted) -> None:
        """Record what the runner made of an admitted request."""
        kind = result.kind
        if kind is Admission.RESTORE:
            assert result.loading is not None
            state.status = Status.RESTORING
            self.restoring[state] = result.loading
            return
        if kind in (Admission.ANSWERED, Admission.FAILED):
            self.by_id.pop(state.id, None)
            _ended(state)
            assert result.event is not None
            self.output.emit(state, result.event)
            return
        if kind is Admission.RESUMED:
            state.status = Status.DECODING
        else:
            state.status = Status.PREFILLING
            if self.budget is not None:
                state.reserved = self.budget.reservation(state.prompt_len, state.request.max_tokens)
        self.running[state.seq] = state
        if kind is Admission.SOLO:
            self.solo = state
        elif kind is Admission.PREFILL:
            self.prefilling.append(state)

    def restored(self, ready: list[tuple[RequestState, Loading | None]]) -> None:
        """Restores made ready ahead (None: failed, restored in line instead): first in line, in order."""
        for state, loading in reversed(ready):
            del self.restoring[state]
            state.loading = loading
            state.status = Status.WAITING
            self.waiting.appendleft(state)

    def shares_a_prefill(self, state: RequestState) -> bool:
        """A running request still computes (or is about to store) at least half of this
        one's prompt: it waits for those blocks rather than computing them a second time."""
        block = self.block_size
        prompt = state.request.prompt_tokens
        if not block or len(prompt) < 2 * block:
            return False
        for other in self.running.values():
            if not (other.first_token is None or other.store_prompt or other in self.prompt_stores):
                continue
            shared = shared_blocks(prompt, other.request.prompt_tokens[: other.prompt_len], block)
            if shared - other.cached_tokens >= block and 2 * shared >= len(prompt):
                return True
        return False

    # ----- memory ------------------------------------------------------------------------
    def kv_held(self, actual: bool = False) -> int:
        """Bytes of KV the running sequences hold (`actual`) or have reserved, if more."""
        bpt = self.budget.bytes_per_token if self.budget else 0
        return bpt * sum(
            s.prompt_len + s.completion_tokens if actual else max(s.reserved, s.prompt_len + s.completion_tokens)
            for s in self.running.values()
        )

    def fits(self, state: RequestState) -> bool:
        """The request's reservation fits next to what the running sequences hold (the hot
        tier yields first). One alone always goes: a prompt that never fits was refused."""
        budget = self.budget
        if state.status is Status.PAUSED or not budget or not budget.bytes_per_token or not self.running:
            return True
        assert self.memory is not None
        req = state.request
        need = budget.reservation(len(req.prompt_tokens), req.max_tokens) * budget.bytes_per_token
        need += getattr(req.vision, "activation_bytes", 0)  # an image prompt's vision tower, for its prefill
        held = self.kv_held()
        short = held + need - self.memory.room(held)
        return short <= 0 or self.memory.yield_memory(short) >= short

    def outgrown(self) -> tuple[RequestState, int] | None:
        """When the decoding sequences outgrew the room (the hot tier yielding first): the
        newest batch sequence to pause, and the bytes short."""
        if len(self.running) < 2 or not self.budget or not self.budget.bytes_per_token:
            return None
        assert self.memory is not None
        held = self.kv_held(actual=True)
        short = held - self.memory.room(held)
        if short <= 0 or self.memory.yield_memory(short) >= short:
            return None
        batch = [s for s in self.running.values() if s.solo is None and s.first_token is not None]
        if len(batch) < 2:
            return None
        return max(batch, key=lambda s: s.start), short

    def paused(self, state: RequestState) -> None:
        """The runner stored a paused sequence's cache: it waits first in line."""
        del self.running[state.seq]
        if state in self.prompt_stores:
            self.prompt_stores.remove(state)
        state.status = Status.PAUSED
        self.paused_for_memory += 1
        self.waiting.appendleft(state)

    # ----- the step ------------------------------------------------------------------------
    def schedule(self, prefill_batch: int) -> StepPlan:
        """The next step: the solo sequence's, else up to `prefill_batch` newcomers' chunks and
        a batch step; batch prompts waiting to be stored come due after it."""
        if self.solo is not None:
            return StepPlan(solo=self.solo)
        due, self.prompt_stores = self.prompt_stores, []
        return StepPlan(prefill=self.prefilling[:prefill_batch], single=len(self.running) == 1, due=due)

    def update_step(self, plan: StepPlan, out: StepOut) -> Update:
        """The runner's outputs for `plan`: tokens into events, newcomers that joined the
        batch, prompt stores requested and those due now (the first token is out)."""
        for state in out.joined:
            self.prefilling.remove(state)
        # stored one step after their prefill ends at the earliest: that step produces the
        # sequence's first token, which goes out before the store
        self.prompt_stores.extend(out.ended)
        result = self.update(out.tokens)
        for state in plan.due:
            if self.running.get(state.seq) is not state:  # a sequence that finished was stored whole
                continue
            if state.first_token_out():
                result.prompt_stores.append(state)
            else:
                self.prompt_stores.append(state)
        return result

    def update(self, outs: list[TokenOut]) -> Update:
        """Tokens into events (sent in one hand-over), finishes, and the stores they ask for."""
        result = Update()
        touched: list[RequestState] = []
        for out in outs:
            state = out.state
            if state.status is Status.FINISHED:  # a stop string ended it at an earlier token of this step
                continue
            hit = self.output.add_token(state, out)
            if hit:
                if out.finish_reason is None:
                    result.dropped.append(state)
                self.finish(state, "stop")
            elif out.finish_reason is not None:
                self.finish(state, out.finish_reason)  # the answer goes out first, then the copy work
                if out.prompt_cache is not None and out.all_tokens is not None:
                    result.stores.append(
                        (list(out.all_tokens), out.prompt_cache, out.boundary_states, state.request.image_keys)
                    )
            else:
                touched.append(state)
        self.output.flush([s for s in touched if s.status is not Status.FINISHED])
        return result


class Places:
    """Places (running or waiting) claimed before a response starts (event loop only): a
    stream refused later could only say so in-band."""

    def __init__(self, model_id: str, max_concurrent: int, max_waiting: int, check: Callable[[], None] = lambda: None) -> None:
        """`check` raises when no request can be served at all (the device is lost)."""
        self.model_id = model_id
        self.check = check
        self.max_concurrent = max_concurrent
        self.max_waiting = max_waiting
        self.outstanding = 0  # reserved or submitted, and not finished
        self.reserved: set[str] = set()  # request ids with a place claimed, not yet submitted
        self.stopping: str | None = None  # why new requests are refused

    def reserve(self, requests: list[GenerationRequest]) -> None:
        """A place for each of `requests`, or `OverloadedError` (429) for all of them."""
        self.check()
        if self.stopping is not None:
            raise ServiceUnavailableError(self.stopping)
        if self.outstanding + len(requests) > self.max_concurrent + self.max_waiting:
            raise OverloadedError(
                f"Model '{self.model_id}' is busy: {self.max_concurrent} requests running and "
                f"{self.max_waiting} waiting. Retry shortly.",
                retry_after=2,
            )
        self.outstanding += len(requests)
        self.reserved.update(r.request_id for r in requests)

    def take(self, request: GenerationRequest) -> None:
        """The request is submitted: its place (reserved now if it had none) is taken."""
        if self.stopping is not None:
            raise ServiceUnavailableError(self.stopping)
        if request.request_id not in self.reserved:
            self.reserve([request])
        self.reserved.discard(request.request_id)

    def give_back(self, request: GenerationRequest) -> None:
        """A reserved place that was never taken goes back."""
        if request.request_id in self.reserved:
            self.reserved.discard(request.request_id)
            self.outstanding -= 1

    def finished(self) -> None:
        """A submitted request's stream ended."""
        self.outstanding -= 1


def _ended(state: RequestState) -> None:
    state.status = Status.FINISHED
    state.release()


def shared_blocks(a: list[int], b: list[int], block: int) -> int:
    """Tokens of the whole blocks that `a` and `b` begin with alike."""
    n = 0
    while n + block <= min(len(a), len(b)) and a[n : n + block] == b[n : n + block]:
        n += block
    return n
