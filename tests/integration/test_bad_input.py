"""A corpus of bad input for every endpoint of a real `omlx serve`: each case gets a 4xx in the
caller's dialect, and after each one the server still answers a greedy and a sampled request.

The cases are the ones a tester found giving 5xx, poisoning later requests or passing with a
200 where a 4xx is due, and their kin. A new endpoint belongs here too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

MODEL = "tiny-llama"
USER = [{"role": "user", "content": "hello there"}]
CHAT = {"model": MODEL, "messages": USER, "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
MESSAGES = {"model": MODEL, "messages": USER, "max_tokens": 2}
RESPONSES = {"model": MODEL, "input": "hello", "max_output_tokens": 2}


def deep(n: int) -> str:
    """A JSON document nested `n` arrays deep."""
    return "[" * n + "]" * n


def fn_tool(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": function}


@dataclass
class Case:
    name: str
    method: str
    path: str
    body: Any = None  # a JSON value, or raw bytes/str sent as is
    status: tuple[int, ...] = (400,)
    mentions: str | None = None  # a word the error message must contain (the field at fault)


def chat(name: str, mentions: str | None = None, status: tuple[int, ...] = (400,), **fields: Any) -> Case:
    return Case(name, "POST", "/v1/chat/completions", {**CHAT, **fields}, status, mentions)


def completion(name: str, mentions: str | None = None, **fields: Any) -> Case:
    return Case(name, "POST", "/v1/completions", {**COMPLETION, **fields}, (400,), mentions)


def messages(name: str, mentions: str | None = None, **fields: Any) -> Case:
    return Case(name, "POST", "/v1/messages", {**MESSAGES, **fields}, (400,), mentions)


def responses(name: str, mentions: str | None = None, **fields: Any) -> Case:
    return Case(name, "POST", "/v1/responses", {**RESPONSES, **fields}, (400,), mentions)


SAMPLING_CASES = [
    chat("top_k negative", "top_k", top_k=-5, temperature=1),
    chat("top_k beyond any int", "top_k", top_k=2**70, temperature=1),
    chat("top_p zero", "top_p", top_p=0, temperature=1),
    chat("top_p above one", "top_p", top_p=1.5),
    chat("min_p above one", "min_p", min_p=2),
    chat("temperature negative", "temperature", temperature=-1),
    chat("temperature too high", "temperature", temperature=3),
    chat("repetition_penalty denormal with logprobs", "repetition_penalty", repetition_penalty=5e-324, logprobs=True),
    chat("repetition_penalty zero", "repetition_penalty", repetition_penalty=0),
    chat("repetition_penalty huge", "repetition_penalty", repetition_penalty=1e308),
    chat("presence_penalty out of range", "presence_penalty", presence_penalty=5),
    chat("frequency_penalty out of range", "frequency_penalty", frequency_penalty=-3),
    chat("seed beyond 64 bits", "seed", seed=2**70),
    chat("seed below int64", "seed", seed=-(2**70)),
    chat("logit_bias key of 5,000 digits", "logit_bias", logit_bias={"7" * 5000: 1}),
    chat("logit_bias key outside the vocabulary", "logit_bias", logit_bias={"99999999": 1}),
    chat("logit_bias negative key", "logit_bias", logit_bias={"-3": 1}),
    chat("logit_bias key not a number", "logit_bias", logit_bias={"abc": 1}),
    chat("logit_bias value out of range", "logit_bias", logit_bias={"5": 1000}),
    chat("n zero", "n", n=0),
    chat("n too many", "n", n=17),
    chat("top_logprobs too many", "top_logprobs", logprobs=True, top_logprobs=21),
    chat("top_logprobs negative", "top_logprobs", logprobs=True, top_logprobs=-1),
    chat("stop: 17 strings", "stop", stop=[f"s{i}" for i in range(17)]),
    chat("stop: an empty string", "stop", stop=[""]),
    chat("stop: a huge string", "stop", stop="x" * 5000),
    chat("max_tokens negative", "max_tokens", max_tokens=-1),
    chat("max_tokens not a number", "max_tokens", max_tokens="many"),
    chat("max_tokens zero", "max_tokens", max_tokens=0),
    completion("completions top_k negative", "top_k", top_k=-2, temperature=1),
    completion("completions logprobs too many", "logprobs", logprobs=21),
    completion("completions seed beyond 64 bits", "seed", seed=2**64),
    messages("messages top_k negative", "top_k", top_k=-2),
    messages("messages temperature too high", "temperature", temperature=7),
    messages("messages 1,000 stop_sequences", "stop_sequences", stop_sequences=[f"s{i}" for i in range(1000)]),
    messages("messages empty stop sequence", "stop_sequences", stop_sequences=[""]),
    responses("responses top_p zero", "top_p", top_p=0),
    responses("responses temperature negative", "temperature", temperature=-0.5),
]

NAN_CASES = [
    Case("chat temperature NaN", "POST", "/v1/chat/completions",
         '{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
         (400,), "temperature"),
    Case("chat top_p Infinity", "POST", "/v1/chat/completions",
         '{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "top_p": Infinity}',
         (400,), "top_p"),
    Case("chat logit_bias -Infinity", "POST", "/v1/chat/completions",
         '{"model": "tiny-llama", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": -Infinity}}',
         (400,), "logit_bias"),
    Case("messages temperature NaN", "POST", "/v1/messages",
         '{"model": "tiny-llama", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
         (400,), "temperature"),
]

TOOL_CASES = [
    chat("tool_choice function as a string", "tool_choice",
         tools=[fn_tool(name="f", parameters={"type": "object"})], tool_choice={"type": "function", "function": "f"}),
    chat("tool_choice names an undeclared tool", "tool_choice",
         tools=[fn_tool(name="f", parameters={"type": "object"})], tool_choice={"type": "function", "function": {"name": "g"}}),
    chat("tool_choice unknown string", "tool_choice", tool_choice="sometimes"),
    chat("tool parameters not a schema", "parameters", tools=[fn_tool(name="f", parameters="notaschema")]),
    chat("tool parameters of a type that does not exist", "parameters",
         tools=[fn_tool(name="f", parameters={"type": "banana"})]),
    chat("tool without a name", "name", tools=[fn_tool(description="no name", parameters={"type": "object"})]),
    chat("tool with a numeric name", "name", tools=[fn_tool(name=5, parameters={"type": "object"})]),
    chat("tool with an empty name", "name", tools=[fn_tool(name="", parameters={"type": "object"})]),
    chat("tool of an unknown type", "tools", tools=[{"type": "spaceship", "function": {"name": "f"}}]),
    chat("tool that is not an object", "tools", tools=[5]),
    chat("tool function that is not an object", "function", tools=[{"type": "function", "function": "f"}]),
    chat("assistant tool_calls whose function is a string", "function",
         messages=[*USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function", "function": "f"}]}]),
    chat("assistant tool_calls without a name", "name",
         messages=[*USER, {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"arguments": "{}"}}]}]),
    chat("assistant tool_call arguments not text or object", "arguments",
         messages=[*USER, {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": 5}}]}]),
    chat("messages empty", "messages", messages=[]),
    chat("message role unknown", "role", messages=[{"role": "wizard", "content": "x"}]),
    chat("message content a number", "content", messages=[{"role": "user", "content": 5}]),
    chat("message content part text not a string", "text",
         messages=[{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]),
    messages("anthropic tools: an empty object", "name", tools=[{}]),
    messages("anthropic tool without a name", "name", tools=[{"input_schema": {"type": "object"}}]),
    messages("anthropic tool with a numeric name", "name", tools=[{"name": 5, "input_schema": {"type": "object"}}]),
    messages("anthropic tool input_schema not a schema", "input_schema", tools=[{"name": "f", "input_schema": "x"}]),
    messages("anthropic tool input_schema bad type", "input_schema",
             tools=[{"name": "f", "input_schema": {"type": "banana"}}]),
    messages("anthropic tool_choice of an unknown type", "tool_choice", tool_choice={"type": "maybe"}),
    messages("anthropic tool_choice tool without a name", "tool_choice", tool_choice={"type": "tool"}),
    messages("anthropic tool_result content a number", "content", messages=[*USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": 5}]}]),
    messages("anthropic tool_result content a list of strings", "content", messages=[*USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": ["x"]}]}]),
    messages("anthropic tool_use input not an object", "input", messages=[*USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": "x"}]}]),
    messages("anthropic text block text not a string", "text", messages=[{"role": "user", "content": [
        {"type": "text", "text": 5}]}]),
    messages("anthropic content block not an object", "content", messages=[{"role": "user", "content": [5]}]),
    messages("anthropic content block without a type", "type", messages=[{"role": "user", "content": [{"text": "x"}]}]),
    messages("anthropic role tool", "role", messages=[{"role": "tool", "content": "x"}]),
    messages("anthropic system block text not a string", "system", system=[{"type": "text", "text": 5}]),
    Case("count_tokens tools: an empty object", "POST", "/v1/messages/count_tokens",
         {"model": MODEL, "messages": USER, "tools": [{}]}, (400,), "name"),
    Case("count_tokens tool without a name", "POST", "/v1/messages/count_tokens",
         {"model": MODEL, "messages": USER, "tools": [{"input_schema": {"type": "object"}}]}, (400,), "name"),
    responses("responses function_call arguments a number", "arguments",
              input=[{"type": "function_call", "call_id": "c1", "name": "f", "arguments": 5}]),
    responses("responses function tool without a name", "name", tools=[{"type": "function"}]),
    responses("responses function tool parameters not a schema", "parameters",
              tools=[{"type": "function", "name": "f", "parameters": {"type": "banana"}}]),
    responses("responses namespace tools a number", "tools", tools=[{"type": "namespace", "name": "ns", "tools": 5}]),
    responses("responses input a number", "input", input=5),
    responses("responses message content a number", "content",
              input=[{"type": "message", "role": "user", "content": 5}]),
    responses("responses function_call_output output a number", "output",
              input=[{"type": "function_call_output", "call_id": "c1", "output": 5}]),
    responses("responses tool that is not an object", "tools", tools=["x"]),
]

PROMPT_CASES = [
    completion("prompt empty list", "prompt", prompt=[]),
    completion("prompt empty string list entry", "prompt", prompt=[[]]),
    completion("prompt token negative", "prompt", prompt=[-1]),
    completion("prompt token beyond the vocabulary", "prompt", prompt=[10**9]),
    completion("prompt token beyond any int", "prompt", prompt=[2**70]),
    completion("prompt mixed types", "prompt", prompt=["a", 1]),
    completion("prompt a number", "prompt", prompt=5),
    Case("model missing", "POST", "/v1/chat/completions", {"messages": USER}, (400,), "model"),
    Case("model unknown", "POST", "/v1/chat/completions", {**CHAT, "model": "nope"}, (404,), "nope"),
    Case("body not JSON", "POST", "/v1/chat/completions", "{not json", (400,)),
    Case("body a JSON array", "POST", "/v1/chat/completions", [1, 2], (400,)),
    Case("embeddings input empty", "POST", "/v1/embeddings", {"model": MODEL, "input": []}, (400,)),
    Case("embeddings input a number", "POST", "/v1/embeddings", {"model": MODEL, "input": 5}, (400,)),
    Case("rerank documents a number", "POST", "/v1/rerank", {"model": MODEL, "query": "q", "documents": 5}, (400,)),
]

DEEP_ROUTES = [
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/responses"), ("POST", "/v1/embeddings"),
    ("POST", "/v1/rerank"), ("PUT", "/api/settings"), ("POST", "/api/keys"),
    ("PUT", f"/api/models/{MODEL}/settings"), ("POST", f"/api/models/{MODEL}/profiles/p"),
    ("PUT", f"/api/models/{MODEL}/profiles/p"), ("POST", "/api/bench"), ("POST", "/api/downloads"),
    ("POST", "/api/auth/login"),
]
DEEP_CASES = [Case(f"10,000-deep JSON on {m} {p}", m, p, deep(10_000), (400,), "nested") for m, p in DEEP_ROUTES]
DEEP_CASES += [
    Case("10,000-deep tool schema", "POST", "/v1/chat/completions",
         json.dumps({**CHAT, "tools": [fn_tool(name="f", parameters=json.loads(deep(150)))]}), (400,), "nested"),
    Case("a body over the size limit", "POST", "/v1/chat/completions",
         json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * (65 << 20)}]}), (413,)),
]

ALL_CASES = SAMPLING_CASES + NAN_CASES + TOOL_CASES + PROMPT_CASES + DEEP_CASES


@pytest.fixture(scope="module")
def http(tiny_server) -> httpx.Client:
    with httpx.Client(base_url=tiny_server.base_url, timeout=120) as client:
        yield client


def send(http: httpx.Client, case: Case) -> httpx.Response:
    if isinstance(case.body, (str, bytes)):
        return http.request(case.method, case.path, content=case.body, headers={"content-type": "application/json"})
    return http.request(case.method, case.path, json=case.body)


def error_message(case: Case, response: httpx.Response) -> str:
    """The error's message, checked to be in the dialect of the route."""
    body = response.json()
    if case.path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) >= {"type", "message"}, body
        return body["error"]["message"]
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    return body["error"]["message"] + " " + str(body["error"]["param"])


def still_serving(http: httpx.Client) -> None:
    """A greedy and a sampled request both answer (the sampler's shared state is intact)."""
    greedy = http.post("/v1/chat/completions", json={**CHAT, "temperature": 0})
    assert greedy.status_code == 200, greedy.text
    sampled = http.post("/v1/chat/completions", json={**CHAT, "temperature": 0.9, "top_p": 0.9, "top_k": 40})
    assert sampled.status_code == 200, sampled.text
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("case", ALL_CASES, ids=[c.name for c in ALL_CASES])
def test_bad_input_gets_a_4xx_naming_the_fault(http, case: Case):
    response = send(http, case)
    assert response.status_code in case.status, f"{case.name}: {response.status_code} {response.text[:500]}"
    message = error_message(case, response)
    if case.mentions:
        assert case.mentions.lower() in message.lower(), f"{case.name}: {message}"
    still_serving(http)


POISONING = [
    {"top_k": 100000, "temperature": 1},  # beyond the vocabulary: no limit, like 0
    {"top_k": 512, "temperature": 1},  # exactly the tiny vocabulary
    {"top_k": 1, "temperature": 1},
    {"seed": 0, "temperature": 1, "top_k": 100000},
    {"seed": -1, "temperature": 1},
    {"seed": 2**64 - 1, "temperature": 1},
    {"min_p": 1.0, "temperature": 1},
    {"top_p": 1e-9, "temperature": 1},
    {"temperature": 1e-9},
    {"repetition_penalty": 0.01, "logprobs": True, "top_logprobs": 20},
    {"repetition_penalty": 100, "logprobs": True, "top_logprobs": 20},
    {"logit_bias": {"5": 100, "6": -100}, "temperature": 1, "logprobs": True, "top_logprobs": 5},
]


@pytest.mark.parametrize("fields", POISONING, ids=[json.dumps(f) for f in POISONING])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_edge_sampling_values_serve_and_never_poison_later_requests(http, fields: dict[str, Any], stream: bool):
    """Valid but extreme values answer 200 with finite JSON numbers, and sampled requests after
    them still work (a failure inside one request's sampling once broke MLX's shared random
    state for every later request)."""
    body = {**CHAT, "max_tokens": 4, "stream": stream, **fields}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        text = response.read().decode()
    assert response.status_code == 200, text
    assert "NaN" not in text and "Infinity" not in text, text
    if stream:
        payloads = [line[6:] for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
        assert payloads and all("error" not in json.loads(p) for p in payloads), text
    else:
        json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON number {c}"))
    still_serving(http)
    plain = {k: v for k, v in fields.items() if k not in ("logprobs", "top_logprobs")}  # chat's forms
    for endpoint, body in [("/v1/completions", {**COMPLETION, "max_tokens": 3, **plain}),
                           ("/v1/messages", {**MESSAGES, "temperature": 1, "top_k": fields.get("top_k", 5)})]:
        answer = http.post(endpoint, json=body)
        assert answer.status_code == 200, answer.text
    still_serving(http)
