"""How the runner admits requests on a vision-language model (engine thread): a vision prompt is
always prefilled by the engine itself, its chunks carrying image features and M-RoPE positions
(`VisionPrefill`), its cache carrying its rope delta; every cache that enters the
`BatchGenerator` of such a model carries one (0 for text), so rows of both decode in one step
(docs/design/vision.md)."""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import make_prompt_cache

from omlx.engine.request_state import RequestState
from omlx.engine.vision_lm import VisionLM, with_delta


def is_vision(model: Any) -> bool:
    return isinstance(model, VisionLM)


def solo_parts(model: VisionLM, state: RequestState, cache: list[Any] | None, cached: int) -> tuple[list[Any], Any]:
    """The vision prompt's cache (the restored prefix, or a fresh one) carrying its rope delta, and its
    prefill after `cached` tokens (image features computed here, once; not for images inside the prefix)."""
    req = state.request
    prefill = model.prefill(req.prompt_tokens, req.vision, cached)  # VisionPrefill, or OcrPrefill
    state.rope_delta = prefill.delta
    own = with_delta(cache if cache is not None else make_prompt_cache(model), prefill.delta)
    assert own is not None
    return own, prefill


def batch_cache(model: VisionLM, cache: list[Any] | None, state: RequestState) -> list[Any]:
    """A cache for `BatchGenerator.insert` on a vision model: always one, carrying the row's delta."""
    req = state.request
    if req.vision is not None and len(req.prompt_tokens) > 0:
        have = cache[0].offset if cache else 0
        if have < req.vision.end:  # its images would be fed as plain tokens: never
            raise RuntimeError("a vision request's images are not in its cache (it was paused and they were evicted)")
    out = with_delta(cache if cache is not None else make_prompt_cache(model), state.rope_delta)
    assert out is not None
    return out
