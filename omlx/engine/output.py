"""Tokens into a request's events: text through its detokenizer and stop strings, the finish
event with the usage, and one log line per request (pure Python, on the engine thread)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from omlx.engine.request import GenerationEvent, TokenLogprob
from omlx.engine.request_state import RequestState, Status, TokenOut

log = logging.getLogger("omlx.engine")

EmitMany = Callable[[list[tuple[RequestState, GenerationEvent]]], None]


class Output:
    """Builds and sends the events of an engine's requests through `emit_many` (the bridge);
    `token_logprob(logprobs, token, top)` reads a token's logprobs (the runner's arrays)."""

    def __init__(
        self,
        model_id: str,
        emit_many: EmitMany,
        token_logprob: Callable[[Any, int, int], TokenLogprob],
        on_finished: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.model_id = model_id
        self.emit_many = emit_many
        self.token_logprob = token_logprob
        self.on_finished = on_finished  # called with each request's numbers
        self.eos_ids: list[int] = []  # set at load

    def emit(self, state: RequestState, event: GenerationEvent) -> None:
        self.emit_many([(state, event)])

    def add_token(self, state: RequestState, out: TokenOut) -> bool:
        """Add `out` to the request's pending event; whether a stop string matched."""
        if state.first_token is None:
            state.first_token = time.perf_counter()
            state.status = Status.DECODING
        state.completion_tokens += 1
        req = state.request
        is_stop_token = out.finish_reason == "stop" and (out.token in self.eos_ids or out.token in req.stop_token_ids)
        ev = state.pending
        if not is_stop_token:
            state.detokenizer.add_token(out.token)
            ev.token_ids.append(out.token)
            state.generated.append(out.token)
            if req.logprobs is not None:
                ev.logprobs.append(self.token_logprob(out.logprobs, out.token, req.logprobs))
        if out.finish_reason is not None:
            state.detokenizer.finalize()
        text, hit = state.stops.feed(state.detokenizer.last_segment, final=out.finish_reason is not None)
        ev.text += text
        return hit

    def flush(self, states: list[RequestState]) -> None:
        """Send what each of `states` has pending, all in one hand-over to the event loop."""
        out = []
        for state in states:
            ev = state.pending
            if ev.text or ev.token_ids or ev.prompt_logprobs is not None:
                state.pending = GenerationEvent()
                out.append((state, ev))
        if out:
            self.emit_many(out)

    def finish(self, state: RequestState, reason: str, error: str | None = None) -> None:
        """Log the request and hand its numbers on, then send its last event with its usage: a
        client that has its answer finds it in the counters, /metrics and the log already."""
        ev = state.pending
        ev.finish_reason = reason  # type: ignore[assignment]
        ev.error = error
        ev.prompt_tokens = state.prompt_len
        ev.cached_tokens = state.cached_tokens
        ev.completion_tokens = state.completion_tokens
        ev.first_token_time = state.first_token
        ev.stop_string = state.stops.matched if state.stops is not None else None
        ev.cache = state.cache_report.to_dict() if state.cache_report is not None else None
        self.log_finished(state, reason)
        self.emit(state, ev)

    def log_finished(self, state: RequestState, reason: str) -> None:
        """The request's log line, and its numbers to `on_finished`."""
        now = time.perf_counter()
        ttft = (state.first_token or now) - state.start
        decode_s = now - (state.first_token or now)
        tps = (state.completion_tokens - 1) / decode_s if decode_s > 0 and state.completion_tokens > 1 else 0.0
        log.info(
            "request=%s model=%s prompt=%d cached=%d completion=%d queue=%.3fs ttft=%.3fs restore=%.3fs "
            "decode=%.1ftok/s finish=%s cache=%s%s%s",
            state.id, self.model_id, state.prompt_len, state.cached_tokens, state.completion_tokens, state.queued,
            ttft, state.prefill_start - state.start, tps, reason, "hit" if state.cached_tokens else "miss",
            f" {report.log_fields()}" if (report := state.cache_report) is not None else "",
            f" drafted={state.drafted} accepted={state.accepted}" if state.drafted else "",
        )  # fmt: skip
        if self.on_finished is not None:
            self.on_finished(
                self.model_id,
                {
                    "request_id": state.id,
                    "finish_reason": reason,
                    "prompt_tokens": state.prompt_len,
                    "cached_tokens": state.cached_tokens,
                    "completion_tokens": state.completion_tokens,
                    "queue_s": state.queued,
                    "ttft_s": ttft,
                    "decode_s": decode_s,
                    "e2e_s": now - state.start,
                    "decode_tps": tps,
                    "drafted_tokens": state.drafted,
                    "accepted_tokens": state.accepted,
                    "cache": state.cache_report,
                },
            )
