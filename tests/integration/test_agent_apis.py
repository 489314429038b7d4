"""Anthropic Messages and OpenAI Responses through a real server, with the official SDKs."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.support.server import ServerProcess
from tests.support.tiny_model import build_tiny_llama

MODEL = "tiny-llama"
NO_EOS = "tiny-llama-no-eos"  # never samples its end-of-sequence token: output runs to its budget
WINDOW = 1024  # NO_EOS's context window: short, so that a prompt fills it in well under a second
GREEDY = {"temperature": 0}  # current anthropic SDKs no longer take sampling arguments; the API does
TOOLS = [
    {
        "name": "get_weather",
        "description": "Current weather for a city",
        "input_schema": {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    }
] + [
    {"name": f"tool_{i}", "description": f"Tool number {i}",
     "input_schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}
    for i in range(26)
]


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """Agent prompts are large (27 tool schemas): a tiny model with a 16k window."""
    root = tmp_path_factory.mktemp("agent-models")
    build_tiny_llama(root / MODEL, context=16384)
    build_tiny_llama(root / NO_EOS, context=WINDOW, eos_unreachable=True)  # loaded on first use
    server = ServerProcess(tmp_path_factory.mktemp("agent-home"), ["--model-dir", str(root), "--model", MODEL])
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def claude(tiny_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tiny_server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_messages_non_streaming_with_usage(claude):
    msg = claude.messages.create(
        model=MODEL, max_tokens=12, system="Be brief.", extra_body=GREEDY,
        messages=[{"role": "user", "content": "hello"}],
    )
    assert msg.role == "assistant" and msg.type == "message"
    assert msg.content[0].type == "text"
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.output_tokens >= 1
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) > 5


def test_messages_streaming_event_sequence_matches_non_streaming(claude):
    kwargs = dict(model=MODEL, max_tokens=16, extra_body=GREEDY, messages=[{"role": "user", "content": "stream please"}])
    full = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start"
    assert "content_block_start" in events and "content_block_stop" in events
    assert events[-2:] == ["message_delta", "message_stop"] or events[-1] == "message_stop"
    assert final.content[0].text == full.content[0].text
    assert final.stop_reason == full.stop_reason


def test_messages_stream_sends_ping_first(tiny_server):
    body = {"model": MODEL, "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", tiny_server.base_url + "/v1/messages", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line.startswith("event: ")]
    assert lines[:2] == ["event: message_start", "event: ping"]


def test_stop_sequence_reported(claude):
    full = claude.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY,
                                  messages=[{"role": "user", "content": "numbers like"}]).content[0].text
    stop = full[8:11]
    msg = claude.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY, stop_sequences=[stop],
                                 messages=[{"role": "user", "content": "numbers like"}])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == full[: full.index(stop)]


def test_real_client_payload_with_tool_round_trip_is_accepted(claude, tiny_server):
    """What Claude Code sends: cache_control, adaptive thinking, betas, mid-conversation system,
    25+ tools with 2020-12 schemas, max_tokens 32000, a tool_use → tool_result round trip."""
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "weather in Paris?", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I should call the tool.", "signature": "x"},
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny, 21C"}],
             "cache_control": {"type": "ephemeral"}},
        ]},
        {"role": "system", "content": "Reminder: be concise."},
        {"role": "user", "content": "and tomorrow?"},
    ]
    body = {
        "model": MODEL, "max_tokens": 32000, "messages": messages, "tools": TOOLS,
        "tool_choice": {"type": "auto"},
        "system": [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
        "thinking": {"type": "adaptive"}, "metadata": {"user_id": "user_abc_session_123"},
        "output_config": {"effort": "low"}, "context_management": {"edits": []}, "stream": True,
    }
    headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
               "x-api-key": "whatever"}
    body["max_tokens"] = 8  # keep the test fast; 32000 is checked for clamping below
    with httpx.stream("POST", tiny_server.base_url + "/v1/messages", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("event: ")]
    assert events[-1] == "event: message_stop"
    count = claude.messages.count_tokens(model=MODEL, messages=messages, tools=TOOLS)
    without_result = claude.messages.count_tokens(model=MODEL, messages=messages[:2] + [{"role": "user", "content": "x"}], tools=TOOLS)
    assert count.input_tokens > without_result.input_tokens > 100  # the tools are described to the model


def test_max_tokens_32000_is_clamped(claude):
    """Claude Code's max_tokens 32000, far beyond the model's window, is accepted and clamped
    to what the window leaves after the prompt: with EOS unreachable, exactly that many
    tokens come back, ending on max_tokens."""
    messages = [{"role": "user", "content": "fox " * 960}]
    prompt = claude.messages.count_tokens(model=NO_EOS, messages=messages).input_tokens
    assert 0 < WINDOW - prompt <= 100, prompt  # a short run to the window's end
    msg = claude.messages.create(model=NO_EOS, max_tokens=32000, extra_body=GREEDY, messages=messages)
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == prompt
    assert msg.stop_reason == "max_tokens"
    assert msg.usage.output_tokens == WINDOW - prompt


def test_count_tokens_matches_message_input(claude):
    count = claude.messages.count_tokens(model=MODEL, system="sys", messages=[{"role": "user", "content": "count me"}])
    msg = claude.messages.create(model=MODEL, max_tokens=2, system="sys", messages=[{"role": "user", "content": "count me"}])
    assert count.input_tokens == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)


def test_anthropic_error_format(claude, tiny_server):
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="missing-model", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(tiny_server.base_url + "/v1/messages", json={"model": MODEL, "messages": "nope"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(tiny_server.base_url + "/v1/messages", content=b"{bad json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    long = "fox " * 17000
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": long}])
    assert "16384" in err.value.body["error"]["message"]


def test_head_root_probe(tiny_server):
    assert httpx.head(tiny_server.base_url + "/").status_code == 200


def test_responses_non_streaming_and_chaining(oai):
    # longer than a cache block: on a CUDA GPU a cached prefix is used in whole blocks
    story = "Some context first. " + "The quick brown fox jumps over the lazy dog. " * 40
    first = oai.responses.create(model=MODEL, input=story + "Remember the word fox.", max_output_tokens=8,
                                 temperature=0)  # fmt: skip
    assert first.status in ("completed", "incomplete")
    assert first.output[0].type == "message"
    assert first.usage.input_tokens > 0 and first.usage.output_tokens >= 1
    second = oai.responses.create(model=MODEL, input="what was the word?", previous_response_id=first.id,
                                  max_output_tokens=8, temperature=0)
    # the chained request carries the whole first exchange: longer prompt, and its prefix is cached
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    got = oai.responses.retrieve(first.id)
    assert got.id == first.id
    oai.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=MODEL, input="x", previous_response_id=first.id)


def test_responses_streaming_events(oai):
    stream = oai.responses.create(model=MODEL, input="stream it", max_output_tokens=10, temperature=0, stream=True)
    types = [e.type for e in stream]
    assert types[0] == "response.created"
    assert "response.output_text.delta" in types
    assert types[-1] in ("response.completed", "response.incomplete")


def test_responses_codex_style_payload(oai, tiny_server):
    """store: false with the full history as items, developer messages, namespace and web_search tools."""
    body = {
        "model": MODEL, "store": False, "stream": False, "max_output_tokens": 6,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
            {"type": "message", "role": "user", "id": "msg_1", "content": [{"type": "input_text", "text": "list files"}]},
            {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": json.dumps({"cmd": ["ls"]})},
            {"type": "function_call_output", "call_id": "call_1", "output": "README.md\nsetup.py"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
        ],
        "tools": [
            {"type": "function", "name": "shell", "description": "run", "parameters": {"type": "object", "properties": {"cmd": {"type": "array"}}}},
            {"type": "namespace", "name": "mcp", "tools": [{"type": "function", "name": "search_docs", "parameters": {"type": "object"}}]},
            {"type": "web_search"},
        ],
        "include": ["reasoning.encrypted_content"], "reasoning": {"effort": "medium", "summary": "auto"},
        "prompt_cache_key": "session-1", "parallel_tool_calls": False, "client_metadata": {"x": 1}, "tool_choice": "auto",
    }
    r = httpx.post(tiny_server.base_url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] > 50
    assert "ignoring Responses tool of type 'web_search'" in tiny_server.log()


def test_openai_chat_accepts_assistant_tool_calls_with_empty_content(oai):
    got = oai.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": TOOLS[0]["input_schema"]}}],
    )
    assert got.choices[0].finish_reason in ("stop", "length", "tool_calls")


# --------------------------------------------------------------------------- content agents send

IMAGE_B64 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
DATA_URL = "data:image/png;base64," + IMAGE_B64


def test_unknown_content_types_are_dropped_with_a_note(tiny_server):
    """New block and part types from newer clients never cost a 4xx: left out, and logged."""
    url = tiny_server.base_url
    answers = [
        httpx.post(url + "/v1/messages", timeout=60, json={"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "hologram_a", "data": 1}]}]}),
        httpx.post(url + "/v1/chat/completions", timeout=60, json={"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "hologram_b"}]}]}),
        httpx.post(url + "/v1/responses", timeout=60, json={"model": MODEL, "max_output_tokens": 2, "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}, {"type": "hologram_c"}]}]}),
    ]  # fmt: skip
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    for kind in ("hologram_a", "hologram_b", "hologram_c"):
        assert f"unknown type '{kind}'" in tiny_server.log()


def test_images_at_the_top_level_are_a_400_naming_the_model(tiny_server):
    url = tiny_server.base_url
    answers = [
        httpx.post(url + "/v1/messages", timeout=60, json={"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": IMAGE_B64}}]}]}),
        httpx.post(url + "/v1/chat/completions", timeout=60, json={"model": MODEL, "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": DATA_URL}}]}]}),
        httpx.post(url + "/v1/responses", timeout=60, json={"model": MODEL, "max_output_tokens": 2, "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": DATA_URL}]}]}),
    ]  # fmt: skip
    assert [a.status_code for a in answers] == [400, 400, 400]
    assert answers[0].json()["type"] == "error"  # each in its caller's dialect
    for a in answers:
        assert f"model '{MODEL}'" in a.text and "image" in a.text


def test_an_image_in_a_tool_result_becomes_a_placeholder_and_a_warning(claude, oai, tiny_server):
    """What a screenshot tool returns reaches the model as a placeholder; the answer says so."""
    msg = claude.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, messages=[
        {"role": "user", "content": "take a screenshot"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "done:"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": IMAGE_B64}}]}]},
    ])  # fmt: skip
    assert [w["code"] for w in msg.model_extra["warnings"]] == ["media_omitted"]
    chat = oai.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
        {"role": "user", "content": "take a screenshot"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "image_url", "image_url": {"url": DATA_URL}}]},
    ])  # fmt: skip
    assert [w["code"] for w in chat.choices[0].model_extra["warnings"]] == ["media_omitted"]
    response = oai.responses.create(model=MODEL, max_output_tokens=2, temperature=0, input=[
        {"type": "message", "role": "user", "content": "take a screenshot"},
        {"type": "function_call", "call_id": "call_1", "name": "shot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_image", "image_url": DATA_URL}]},
    ])  # fmt: skip
    assert [w["code"] for w in response.model_extra["warnings"]] == ["media_omitted"]
    placeholder = claude.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": IMAGE_B64}}]}]}])
    empty = claude.messages.count_tokens(model=MODEL, messages=[
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": []}]}])
    assert placeholder.input_tokens > empty.input_tokens + 5  # the model sees the placeholder


def test_a_call_cut_by_max_tokens_is_text_with_a_warning_on_every_api(claude, oai):
    """A forced call (its grammar opens the envelope) cut after a few tokens: never a silent
    stop; the text comes back with the length finish and a `tool_call_unclosed` warning."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": TOOLS[0]["input_schema"]}}]
    ask = [{"role": "user", "content": "weather in Paris?"}]
    kw = dict(model=MODEL, max_tokens=24, temperature=0, tools=tools, tool_choice="required")
    whole = oai.chat.completions.create(messages=ask, **kw).choices[0]
    chunks = list(oai.chat.completions.create(messages=ask, stream=True, **kw))
    streamed = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason][0]
    for choice in (whole, streamed):
        assert choice.finish_reason == "length"
        assert [w["code"] for w in choice.model_extra["warnings"]] == ["tool_call_unclosed"]
    assert whole.message.content.startswith("<tool_call>")
    kw = dict(model=MODEL, max_tokens=24, messages=ask, tools=TOOLS[:1], tool_choice={"type": "any"}, extra_body=GREEDY)
    msg = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        delta = [e for e in stream if e.type == "message_delta"][0]
    assert msg.stop_reason == "max_tokens" and msg.content[0].text.startswith("<tool_call>")
    for warnings in (msg.model_extra["warnings"], delta.model_extra["warnings"]):
        assert [w["code"] for w in warnings] == ["tool_call_unclosed"]
    kw = dict(model=MODEL, input="weather in Paris?", max_output_tokens=24, temperature=0, tool_choice="required",
              tools=[{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["input_schema"]}])
    whole = oai.responses.create(**kw)
    streamed = [e for e in oai.responses.create(stream=True, **kw) if e.type == "response.incomplete"][0].response
    for response in (whole, streamed):
        assert response.status == "incomplete" and not [o for o in response.output if o.type == "function_call"]
        assert [w["code"] for w in response.model_extra["warnings"]] == ["tool_call_unclosed"]


def test_a_models_max_tokens_cap_bounds_what_agents_ask_for(claude, tiny_server):
    """Claude Code asks for 32000 tokens whatever the model: the model's `max_tokens_cap` holds."""
    r = httpx.put(f"{tiny_server.base_url}/api/models/{NO_EOS}/settings", json={"max_tokens_cap": 7}, timeout=30)
    assert r.status_code == 200, r.text
    try:
        msg = claude.messages.create(model=NO_EOS, max_tokens=32000, extra_body=GREEDY,
                                     messages=[{"role": "user", "content": "count"}])
        assert msg.usage.output_tokens == 7 and msg.stop_reason == "max_tokens"
    finally:
        httpx.put(f"{tiny_server.base_url}/api/models/{NO_EOS}/settings", json={"max_tokens_cap": None}, timeout=30)
