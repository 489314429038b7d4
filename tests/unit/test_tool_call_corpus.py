"""The tool-call corpus (tests/support/tool_corpus.py: every family's documented formats, and
real outputs of Qwen2.5-Coder-0.5B and SmolLM2-135M) through the parser, streamed in pieces
and whole, and on to each API's wire format, read back by the official SDKs: every call
arrives, in order, with its arguments; what cannot be read comes back as text with a warning."""

from __future__ import annotations

import json
from typing import Any

import anthropic.types as at
import openai.types.chat as oc
import openai.types.responses as orr
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from openai import omit
from openai.lib.streaming.chat._completions import ChatCompletionStreamState
from openai.lib.streaming.responses._responses import ResponseStreamState
from pydantic import TypeAdapter

from omlx.api.output_parser import OutputParser
from omlx.api.responses_models import ResponsesRequest
from omlx.api.tool_calls import Delta, ReasoningDelta, TextDelta, ToolCall
from omlx.engine.request import GenerationEvent
from omlx.server.anthropic_events import MessageEvents
from omlx.server.chat_chunks import ChatChunks
from omlx.server.chat_pipeline import ChatFinal, final_from
from omlx.server.responses_events import ResponseEvents
from tests.support.tool_corpus import SYNTHETIC, Case, captured_cases, chunkings

CASES = [pytest.param(c, id=c.id) for c in SYNTHETIC + captured_cases()]


def parse(case: Case, pieces: list[str]) -> tuple[list[Delta], OutputParser]:
    parser = OutputParser(family=case.family, tools=case.tools, reasoning=True)
    deltas: list[Delta] = []
    for piece in pieces:
        deltas += parser.feed(piece)
    return deltas + parser.finish(), parser


def items(deltas: list[Delta]) -> list[tuple]:
    """Deltas as the corpus writes them: neighbouring text (reasoning) merged, calls with their
    arguments decoded, or as generated when they are not a JSON object."""
    out: list[tuple] = []
    for d in deltas:
        if isinstance(d, ToolCall):
            out.append(("call", d.name, d.arguments if d.problem else json.loads(d.arguments)))
            continue
        kind = "text" if isinstance(d, TextDelta) else "reasoning"
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + d.text)
        else:
            out.append((kind, d.text))
    return out


def finished(case: Case, parser: OutputParser) -> ChatFinal:
    return final_from(GenerationEvent(finish_reason=case.finish, prompt_tokens=10, completion_tokens=5), parser)


@pytest.mark.parametrize("case", CASES)
def test_the_parser_reads_each_case_alike_in_any_pieces(case: Case):
    for pieces in chunkings(case.text):
        deltas, parser = parse(case, pieces)
        assert items(deltas) == case.expected, (pieces[:6], items(deltas))
        assert [w.code for w in parser.warnings] == case.warnings
        assert finished(case, parser).finish_reason == case.api_finish


def sse_payloads(lines: list[str]) -> list[dict[str, Any]]:
    out = []
    for line in "".join(lines).split("\n"):
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[len("data: "):]))
    return out


def expected_calls(case: Case) -> list[tuple[str, Any]]:
    return [(e[1], e[2]) for e in case.expected if e[0] == "call"]


def expected_text(case: Case) -> str:
    return "".join(e[1] for e in case.expected if e[0] == "text")


def warning_codes(warnings: list[dict[str, str]] | None) -> list[str]:
    return [w["code"] for w in warnings or []]


def chat_arguments(arguments: str, invalid: bool) -> Any:
    return arguments if invalid else json.loads(arguments)


def check_chat(case: Case, deltas: list[Delta], final: ChatFinal) -> None:
    enc = ChatChunks("chatcmpl-1", "m", 0)
    lines = enc.start() + enc.feed(0, deltas) + enc.finish(0, final) + enc.end([final])
    state = ChatCompletionStreamState()
    chunks = sse_payloads(lines)
    for chunk in chunks:
        state.handle_chunk(oc.ChatCompletionChunk.model_validate(chunk))
    body = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [enc.choice_body(0, final)]}
    for completion, warnings in [(state.current_completion_snapshot, chunks[-1]["choices"][0].get("warnings")),
                                 (oc.ChatCompletion.model_validate(body), body["choices"][0].get("warnings"))]:
        choice = completion.choices[0]
        invalid = {c[1] for c in expected_calls(case) if isinstance(c[1], str)}
        calls = [(c.function.name, chat_arguments(c.function.arguments, c.function.arguments in invalid))
                 for c in choice.message.tool_calls or []]
        assert calls == expected_calls(case)
        assert (choice.message.content or "") == expected_text(case)
        assert choice.finish_reason == case.api_finish
        assert warning_codes(warnings) == case.warnings


def check_messages(case: Case, deltas: list[Delta], final: ChatFinal) -> None:
    enc = MessageEvents("msg_1", "m", 10)
    lines = enc.start() + enc.feed(deltas) + enc.finish(final)
    events = []
    for block in "".join(lines).strip().split("\n\n"):
        data = json.loads(block.split("data: ", 1)[1])
        events.append(data)
    adapter = TypeAdapter(at.RawMessageStreamEvent)
    snapshot, bufs = None, {}
    for data in events:
        if data["type"] == "ping":
            continue
        snapshot = accumulate_event(event=adapter.validate_python(data), current_snapshot=snapshot, json_bufs=bufs)
    delta = next(e for e in events if e["type"] == "message_delta")
    body = enc.message(final)
    reason = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}[case.api_finish]
    for message, warnings in [(snapshot, delta.get("warnings")), (at.Message.model_validate(body), body.get("warnings"))]:
        calls = [(b.name, b.input["_raw"] if set(b.input) == {"_raw"} else b.input)
                 for b in message.content if b.type == "tool_use"]
        assert calls == expected_calls(case)
        assert "".join(b.text for b in message.content if b.type == "text") == expected_text(case)
        assert message.stop_reason == reason
        assert warning_codes(warnings) == case.warnings
        ids = [b.id for b in message.content if b.type == "tool_use"]
        assert len(set(ids)) == len(ids) and all(i.startswith("toolu_") for i in ids)


def check_responses(case: Case, deltas: list[Delta], final: ChatFinal) -> None:
    enc = ResponseEvents(ResponsesRequest(model="m", input="x"))
    events = enc.start() + enc.feed(deltas) + enc.finish(final)
    state = ResponseStreamState(input_tools=[], text_format=omit)
    adapter = TypeAdapter(orr.ResponseStreamEvent)
    seen = []
    for _name, payload in events:
        seen += state.handle_event(adapter.validate_python(payload))
    completed = events[-1][1]["response"]
    for response, warnings in [(seen[-1].response, completed.get("warnings")),
                               (orr.Response.model_validate(enc.final_response), enc.final_response.get("warnings"))]:
        invalid = {c[1] for c in expected_calls(case) if isinstance(c[1], str)}
        calls = [(o.name, chat_arguments(o.arguments, o.arguments in invalid))
                 for o in response.output if o.type == "function_call"]
        assert calls == expected_calls(case)
        assert response.output_text == expected_text(case)
        assert response.status == ("incomplete" if case.api_finish == "length" else "completed")
        assert warning_codes(warnings) == case.warnings


@pytest.mark.parametrize("case", CASES)
def test_every_api_delivers_each_case_streamed_and_whole(case: Case):
    """Through each API's encoder, read back by its official SDK (stream accumulators and
    response models): the calls in order with their arguments, the text, finish and warnings."""
    deltas, parser = parse(case, chunkings(case.text)[2])
    final = finished(case, parser)
    assert any(isinstance(d, ReasoningDelta) for d in deltas) == any(e[0] == "reasoning" for e in case.expected)
    check_chat(case, deltas, final)
    check_messages(case, deltas, final)
    check_responses(case, deltas, final)
