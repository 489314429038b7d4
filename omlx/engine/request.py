"""The one internal request/event model that every API converts to and from.

OpenAI chat/completions, Anthropic Messages and Responses all build a
`GenerationRequest` (token ids + sampling + stop rules) and consume the same
stream of `GenerationEvent`s; no API is implemented by translating into another
API's wire format.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from omlx.engine.vision_input import image_keys

_ids = itertools.count(1)


def new_request_id(prefix: str = "req") -> str:
    return f"{prefix}-{int(time.time() * 1000):x}{next(_ids):05d}"


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[int, float] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class GenerationRequest:
    """One sequence to generate. `n > 1` at the API layer becomes n requests."""

    request_id: str
    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # None: off; k >= 0: chosen token + top-k alternatives
    prompt_logprobs: int | None = None  # for completions `echo` + logprobs
    # what the output is held to (`constraints.Constraint`: a grammar, reasoning, a thinking
    # budget), built once per request; None: nothing
    constraint: Any = None
    # a vision prompt's images (`vision_input.VisionInput`): prefilled by the engine with their features
    vision: Any = None
    rewritten_turns: int = 0  # earlier answers the chat template rewrote (the cache's `template` reason)
    created: float = field(default_factory=time.time)

    @property
    def image_keys(self) -> dict[int, bytes] | None:
        """Each image's digest at its first token's position: the prefix cache's extra block keys."""
        return image_keys(self.vision)


FinishReason = Literal["stop", "length", "cancelled", "error"]


# What a token of no probability (or a NaN) is reported as: JSON has no -Infinity or NaN, and
# OpenAI reports -9999.0 for such tokens.
LOGPROB_FLOOR = -9999.0


def finite_logprob(value: float) -> float:
    """`value`, or `LOGPROB_FLOOR` where it is lower, infinite or NaN."""
    return value if math.isfinite(value) and value > LOGPROB_FLOOR else LOGPROB_FLOOR


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class GenerationEvent:
    """A step's worth of output for one request.

    `text` is the new text since the previous event (stop strings already cut),
    `finish_reason` is set on the last event, which also carries the usage.
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    # "invalid_request_error" when the request's own constraint failed (its caller's fault);
    # None: the engine's
    error_type: str | None = None
    stop_string: str | None = None  # set when a stop string (not EOS) ended the output
    prompt_logprobs: list[TokenLogprob | None] | None = None
    first_token_time: float | None = None
    cache: dict[str, Any] | None = None  # on the last event: the prompt's restore by tier and why (`CacheReport`)

    def merge(self, later: GenerationEvent) -> None:
        """Fold a later event of the same request into this one (a consumer that fell behind
        gets one event per wake-up instead of one per step)."""
        self.text += later.text
        self.token_ids += later.token_ids
        self.logprobs += later.logprobs
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        if later.finish_reason is not None:
            self.finish_reason = later.finish_reason
            self.prompt_tokens = later.prompt_tokens
            self.cached_tokens = later.cached_tokens
            self.completion_tokens = later.completion_tokens
            self.error = later.error
            self.error_type = later.error_type
            self.stop_string = later.stop_string
            self.first_token_time = later.first_token_time
            self.cache = later.cache
