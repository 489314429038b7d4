"""The status API's per-request entries: a request's prefill position as it moves on."""

from __future__ import annotations

from types import SimpleNamespace

from omlx.engine.request import GenerationRequest
from omlx.engine.request_state import RequestState, Status


def test_prefill_position_counts_restored_then_computed_tokens_and_caps_at_the_prompt():
    s = RequestState(GenerationRequest("chatcmpl-1", list(range(1000)), 16))
    assert s.view(0.0)["prefilled_tokens"] == 0 and s.view(0.0)["state"] == "waiting"
    s.status, s.cached_tokens, s.start = Status.PREFILLING, 256, 10.0
    assert s.prefill_position() == 256  # restored, nothing computed yet
    s.solo = SimpleNamespace(fed=list(range(768)))  # prefilled by the engine: its fed tokens
    view = s.view(12.5)
    assert view == {"id": "chatcmpl-1", "state": "prefilling", "prompt_tokens": 1000, "cached_tokens": 256,
                    "prefilled_tokens": 768, "completion_tokens": 0, "seconds": 2.5}
    s.solo, s.batch_prefilled = None, 512  # in the BatchGenerator: its prompt responses' progress
    assert s.prefill_position() == 768
    s.batch_prefilled = 5000
    assert s.prefill_position() == 1000
    s.status, s.first_token, s.completion_tokens = Status.DECODING, 13.0, 3
    assert s.view(14.0)["prefilled_tokens"] == 1000 and s.view(14.0)["completion_tokens"] == 3
