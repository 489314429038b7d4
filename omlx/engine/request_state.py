"""One request as the engine holds it, from submission to its last event (pure Python).

Its id is the request's own and never changes; `status` says where it is. The asyncio side
sets `loop`, `events`, `done` and `first_out`; the engine thread sets everything else.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from omlx.cache.loader.loading import Loading
from omlx.cache.plan.restore_plan import RestorePlan
from omlx.engine.request import GenerationEvent, GenerationRequest

# A prompt's blocks are stored once the event loop has passed its first token on to the
# response's writer (`first_out`), or this many seconds after it was emitted (a loop too busy
# must not keep the blocks from later requests), or when the request is cancelled first
# (docs/design/solo-path.md, "Prompt stores after the first token").
FIRST_TOKEN_GRACE_S = 0.05
_seqs = itertools.count()


class Status(Enum):
    WAITING = "waiting"  # in line for admission
    RESTORING = "restoring"  # its cached prefix is being made ready ahead
    PREFILLING = "prefilling"  # admitted; no token generated yet
    DECODING = "decoding"
    PAUSED = "paused"  # its cache went to the prefix cache for memory; first in line
    FINISHED = "finished"


@dataclass(eq=False)
class RequestState:
    """A request's whole state; compared by identity, keyed by `seq` (unique in the process,
    fixed for its life) where the engine keeps it."""

    request: GenerationRequest
    seq: int = field(default_factory=lambda: next(_seqs))
    loop: Any = None  # the asyncio loop its events go to
    events: Any = None  # its asyncio.Queue of `GenerationEvent`s
    status: Status = Status.WAITING
    done: bool = False  # asyncio side: its stream ended or was given up
    first_out: bool = False  # its first event has left the event loop (`Bridge.stream`)
    taken: float | None = None  # when the engine first took it (a read-ahead may follow)
    queued: float = 0.0  # seconds from the API building the request to `taken`
    plan: RestorePlan | None = None  # what its prompt restores (`match`, once per admission)
    loading: Loading | None = None  # the plan being carried out, ahead of its insert
    admit_s: tuple[float, float] = (0.0, 0.0)  # finishing its prefix's stores, asking for a read-ahead
    # set when it is inserted
    uid: int = 0  # its BatchGenerator uid while it runs there (the runner's)
    detokenizer: Any = None
    stops: Any = None  # StopStringMatcher
    prompt_len: int = 0
    cached_tokens: int = 0
    batch_prefilled: int = 0  # prompt tokens in its BatchGenerator cache so far (its prompt responses' progress)
    cache_report: Any = None  # `why.CacheReport`: what its restore took from which tier, and why not more
    start: float = 0.0  # the engine took it (before its cached prefix was restored): TTFT counts from here
    prefill_start: float = 0.0  # after the restore: a prefill's time counts from here
    reserved: int = 0  # tokens of KV memory reserved at admission (`KvBudget.reservation`)
    generated: list[int] = field(default_factory=list)  # token ids emitted so far
    sampler: Any = None  # kept for a hand-off: a seeded sampler's key state goes with it
    processors: list[Any] = field(default_factory=list)
    stop_sequences: Any = None
    solo: Any = None  # its SoloSequence while it runs outside the BatchGenerator
    rope_delta: int = 0  # a vision prompt's M-RoPE delta (engine/vision_lm.py), which its cache carries
    spec: Any = None  # its `Speculation` while it decodes solo and speculates
    spec_aside: str | None = "off"  # why it does not speculate (None: it may), set when it is inserted
    drafted: int = 0  # draft tokens verified for it, and accepted (speculation.md)
    accepted: int = 0
    captures: Any = None  # a stateful model's layer-state snapshots (`Captures`), for its stores
    store_prompt: bool = False  # a solo prefill's prompt blocks are due to be stored
    first_token: float | None = None
    completion_tokens: int = 0
    pending: GenerationEvent = field(default_factory=GenerationEvent)
    chunk_seconds: list[float] = field(default_factory=list)  # a solo prefill's chunks (debug log)

    @property
    def id(self) -> str:
        """The request's own id (cancels name it)."""
        return self.request.request_id

    def view(self, now: float) -> dict[str, Any]:
        """Where it stands, for the status API (read from the event loop while the engine
        thread moves it on: each figure is a single read, so a view may lag one step)."""
        return {
            "id": self.id,
            "state": self.status.value,
            "prompt_tokens": len(self.request.prompt_tokens),
            "cached_tokens": self.cached_tokens,
            "prefilled_tokens": self.prefill_position(),
            "completion_tokens": self.completion_tokens,
            "seconds": round(now - self.start, 3) if self.start else 0.0,
        }

    def prefill_position(self) -> int:
        """Prompt tokens in its cache so far: restored or computed (all of them once it decodes)."""
        total = len(self.request.prompt_tokens)
        if self.status in (Status.WAITING, Status.RESTORING):
            return 0
        if self.first_token is not None or self.status in (Status.DECODING, Status.PAUSED, Status.FINISHED):
            return total
        solo = self.solo
        fed = len(solo.fed) if solo is not None else self.cached_tokens + self.batch_prefilled
        return min(total, max(fed, self.cached_tokens))

    def release(self) -> None:
        """Drop what only its computation needs (its solo cache, layer-state snapshots, sampler
        and processors)."""
        self.solo = None
        self.spec = None
        self.captures = None
        self.sampler = None
        self.processors = []
        self.stop_sequences = None
        self.loading = None

    def first_token_out(self) -> bool:
        """The event loop has passed the first token on, or `FIRST_TOKEN_GRACE_S` have passed
        since it was emitted: the prompt's blocks may be stored now."""
        if self.first_out:
            return True
        return self.first_token is not None and time.perf_counter() - self.first_token > FIRST_TOKEN_GRACE_S


@dataclass
class TokenOut:
    """One token the runner produced for `state` (`logprobs`: the runner's array, read only
    when the request asks for logprobs; `prompt_cache`/`all_tokens`/`boundary_states` on a
    finish, to store)."""

    state: RequestState
    token: int
    logprobs: Any = None
    finish_reason: str | None = None
    prompt_cache: Any = None
    all_tokens: Any = None
    boundary_states: Any = None


@dataclass
class StepPlan:
    """One step, as the scheduler plans it: the solo sequence's step, or the engine's prefill
    chunks for `prefill` then a BatchGenerator step (`single`: one sequence runs); `due`:
    batch prompts whose blocks may be stored after it."""

    solo: RequestState | None = None
    prefill: list[RequestState] = field(default_factory=list)
    single: bool = False
    due: list[RequestState] = field(default_factory=list)


@dataclass
class StepOut:
    """What the runner made of a `StepPlan`: tokens, the newcomers whose prefill joined the
    batch, and the prompts that ended with blocks worth storing."""

    tokens: list[TokenOut] = field(default_factory=list)
    joined: list[RequestState] = field(default_factory=list)
    ended: list[RequestState] = field(default_factory=list)


@dataclass
class Update:
    """What `Scheduler.update` leaves to do: sequences to stop computing (a stop string ended
    them), finished sequences' (tokens, cache, boundary states) to store, and batch prompts to
    store now."""

    dropped: list[RequestState] = field(default_factory=list)
    stores: list[tuple[list[int], Any, Any, Any]] = field(default_factory=list)  # (tokens, cache, states, image keys)
    prompt_stores: list[RequestState] = field(default_factory=list)


__all__ = ["FIRST_TOKEN_GRACE_S", "RequestState", "Status", "StepOut", "StepPlan", "TokenOut", "Update"]
