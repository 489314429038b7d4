"""What every API dialect's wire models share: leniency about unknown fields, no NaN or
infinity anywhere, and the bounds of the sampling and stop fields.

Bounds are checked here, at the edge, so a bad value is a 400 naming the field and never
reaches the engine, where a failure inside sampling would touch every request in the batch.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

# OpenAI documents 4 stop strings; 16 leaves room and keeps the per-token matching cheap.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
# A seed is any 64-bit integer, signed or not (clients send -1 for "any"); it keys the
# request's own generator modulo 2**64.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_LOGIT_BIAS = 1024


class Lenient(BaseModel):
    """Unknown fields are kept and ignored (real clients send more than the API's minimum);
    NaN and infinities are refused in every float field."""

    model_config = ConfigDict(extra="allow", protected_namespaces=(), allow_inf_nan=False)


def _stop_strings(value: list[str] | None) -> list[str] | None:
    if value is None:
        return None
    if len(value) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(value)}")
    for s in value:
        if not s:
            raise ValueError("a stop string must not be empty")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"a stop string may be at most {MAX_STOP_CHARS} characters")
    return value


def _one_or_many(value: str | list[str] | None) -> str | list[str] | None:
    _stop_strings([value] if isinstance(value, str) else value)
    return value


StopList = Annotated[list[str] | None, AfterValidator(_stop_strings)]
StopField = Annotated[str | list[str] | None, AfterValidator(_one_or_many)]
Temperature = Annotated[float | None, Field(ge=0.0, le=2.0)]
TopP = Annotated[float | None, Field(gt=0.0, le=1.0)]
# 0 or -1: no limit; a k at or beyond the vocabulary keeps every token, so it means the same.
TopK = Annotated[int | None, Field(ge=-1, le=2**31 - 1)]
MinP = Annotated[float | None, Field(ge=0.0, le=1.0)]
# Dividing logits by less than 0.01 overflows them to infinity in half precision.
RepetitionPenalty = Annotated[float | None, Field(ge=0.01, le=100.0)]
Penalty = Annotated[float | None, Field(ge=-2.0, le=2.0)]
Seed = Annotated[int | None, Field(ge=SEED_MIN, le=SEED_MAX)]


def token_id_bias(value: dict[str, float] | None) -> dict[str, float] | None:
    """`logit_bias` keys are token ids written as decimal strings; values within [-100, 100]."""
    if not value:
        return value
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
    for key, bias in value.items():
        if not (key.isdigit() and len(key) <= 9):
            raise ValueError(f"keys must be token ids (non-negative integers), got {key[:20]!r}")
        if not -100 <= bias <= 100:
            raise ValueError(f"bias for token {key} must be within [-100, 100]")
    return value


LogitBias = Annotated[dict[str, float] | None, AfterValidator(token_id_bias)]


class SamplingValues(Lenient):
    """The sampling fields every dialect and every model setting bounds alike."""

    temperature: Temperature = None
    top_p: TopP = None
    top_k: TopK = None
    min_p: MinP = None
    repetition_penalty: RepetitionPenalty = None
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
