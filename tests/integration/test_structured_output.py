"""Structured output through a real `omlx serve` and the official SDKs: every form users send is
enforced (JSON schemas on all three APIs, streaming and not; completions regex and Lark), forced
tool calls yield valid arguments with SmolLM2 and Qwen2.5-Coder, thinking budgets force the end
of reasoning, constrained and free rows share a batch unchanged, what cannot be enforced is a 400,
and a grammar that fails mid-batch fails alone. One server holds every model of this module."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import shutil

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.support.qwen_coder import NAME as QWEN
from tests.support.qwen_coder import qwen_coder_dir
from tests.support.server import ServerProcess
from tests.support.structured_schemas import SCHEMAS
from tests.support.tiny_model import build_tiny_llama

SMOL = "SmolLM2-135M-Instruct"
THINKER = "tiny-think"  # random weights, a template that opens <think>, never ends by itself
NO_EOS = "tiny-no-eos"
GREEDY = {"temperature": 0}
D7 = "http://json-schema.org/draft-07/schema#"
# tool shapes as Claude Code and Codex send them
CLAUDE_TOOLS = [
    {"name": "Bash", "description": "Executes a given bash command in a persistent shell session.",
     "input_schema": {"type": "object", "properties": {
         "command": {"type": "string", "description": "The command to execute"},
         "timeout": {"type": "number", "description": "Optional timeout in milliseconds (max 600000)"},
         "description": {"type": "string", "description": "What this command does in 5-10 words."},
         "run_in_background": {"type": "boolean"}},
         "required": ["command"], "additionalProperties": False, "$schema": D7}},
    {"name": "Read", "description": "Reads a file from the local filesystem.",
     "input_schema": {"type": "object", "properties": {
         "file_path": {"type": "string", "description": "The absolute path to the file to read"},
         "offset": {"type": "number"}, "limit": {"type": "number"}},
         "required": ["file_path"], "additionalProperties": False, "$schema": D7}},
]  # fmt: skip
CODEX_TOOLS = [
    {"type": "function", "name": "shell", "description": "Runs a shell command and returns its output.", "strict": False,
     "parameters": {"type": "object", "properties": {
         "command": {"type": "array", "items": {"type": "string"}, "description": "The command to execute"},
         "workdir": {"type": "string"}, "timeout_ms": {"type": "number"}},
         "required": ["command"], "additionalProperties": False}},
    {"type": "function", "name": "update_plan", "description": "Updates the task plan.", "strict": False,
     "parameters": {"type": "object", "properties": {
         "explanation": {"type": "string"},
         "plan": {"type": "array", "items": {"type": "object", "properties": {
             "step": {"type": "string"}, "status": {"type": "string"}}, "required": ["step", "status"],
             "additionalProperties": False}}},
         "required": ["plan"], "additionalProperties": False}},
]  # fmt: skip
# an ambiguous grammar: llguidance's parser outgrows its per-token limit after ~100 tokens of "a"
EXPLODING = 'start: s\ns: s s | s s s | s s s s | s s s s s | "a" | "a" s | s "a" | "a" s "a"'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    from omlx.models.default_model import provision_default_model

    root = tmp_path_factory.mktemp("structured-models")
    provision_default_model(root)
    (root / QWEN).symlink_to(qwen_coder_dir(), target_is_directory=True)
    build_tiny_llama(root / THINKER, eos_unreachable=True, thinking=True)
    build_tiny_llama(root / NO_EOS, eos_unreachable=True)
    home = tmp_path_factory.mktemp("structured-home")
    srv = ServerProcess(home, ["--model-dir", str(root), "--model", SMOL, "--no-cache"])
    srv.start()
    yield srv
    srv.stop()
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600)


def ask(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt + " Answer in JSON."}]


# Each schema goes through one API in one mode, so that every API and mode sees several.
def via_chat(oai, claude, prompt, schema, stream, strict) -> tuple[str, str]:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}
    kwargs = dict(model=SMOL, messages=ask(prompt), max_tokens=150, response_format=fmt, **GREEDY)
    if not stream:
        r = oai.chat.completions.create(**kwargs)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in oai.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


def via_responses(oai, claude, prompt, schema, stream, strict) -> tuple[str, str]:
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": strict}}
    kwargs = dict(model=SMOL, input=ask(prompt), max_output_tokens=150, text=fmt, **GREEDY)
    if not stream:
        r = oai.responses.create(**kwargs)
    else:
        r = [e for e in oai.responses.create(stream=True, **kwargs) if e.type == "response.completed"][0].response
    assert r.text.format.type == "json_schema" and r.text.format.schema_ == schema  # echoed as asked
    return r.output_text, "stop" if r.status == "completed" else r.status


def via_messages(oai, claude, prompt, schema, stream, strict) -> tuple[str, str]:
    kwargs = dict(model=SMOL, max_tokens=150, messages=ask(prompt),
                  extra_body={**GREEDY, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    if not stream:
        m = claude.messages.create(**kwargs)
    else:
        with claude.messages.stream(**kwargs) as s:
            m = s.get_final_message()
    return "".join(b.text for b in m.content if b.type == "text"), "stop" if m.stop_reason == "end_turn" else m.stop_reason


WAYS = [(via_chat, False), (via_chat, True), (via_responses, False), (via_responses, True),
        (via_messages, False), (via_messages, True)]  # fmt: skip


def test_twenty_schemas_are_met_on_every_api_streaming_and_not(oai, claude) -> None:
    def run(i: int) -> tuple[int, str, str]:
        prompt, schema = SCHEMAS[i]
        way, stream = WAYS[i % len(WAYS)]
        return i, *way(oai, claude, prompt, schema, stream, strict=i % 2 == 0)

    with cf.ThreadPoolExecutor(8) as pool:
        for i, text, finish in pool.map(run, range(len(SCHEMAS))):
            assert finish == "stop", (i, text)
            jsonschema.validate(json.loads(text), SCHEMAS[i][1])


def test_sampling_works_under_a_grammar_and_a_seed_repeats(oai) -> None:
    prompt, schema = SCHEMAS[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}

    def sample(seed: int) -> str:
        r = oai.chat.completions.create(model=SMOL, messages=ask(prompt), max_tokens=60, temperature=0.9, top_p=0.9,
                                        seed=seed, response_format=fmt)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        return r.choices[0].message.content

    first = sample(7)
    assert sample(7) == first
    assert len({first, sample(8), sample(9)}) > 1  # sampled, not greedy


def test_completions_take_a_regex_a_lark_grammar_and_a_schema(oai) -> None:
    date = oai.completions.create(model=SMOL, prompt="Today's date is", max_tokens=20, **GREEDY,
                                  extra_body={"regex": r" ?[0-9]{4}-[0-9]{2}-[0-9]{2}\."})
    assert re.fullmatch(r" ?[0-9]{4}-[0-9]{2}-[0-9]{2}\.", date.choices[0].text) and date.choices[0].finish_reason == "stop"
    lark = 'start: " The answer is " ANSWER "."\nANSWER: "yes" | "no"'
    answer = oai.completions.create(model=SMOL, prompt="Is the sky blue?", max_tokens=20, **GREEDY,
                                    extra_body={"grammar": lark})
    assert answer.choices[0].text.strip() in ("The answer is yes.", "The answer is no.")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    obj = oai.completions.create(model=SMOL, prompt="JSON:", max_tokens=20, **GREEDY, extra_body={"json_schema": schema})
    jsonschema.validate(json.loads(obj.choices[0].text), schema)


def test_what_cannot_be_enforced_is_a_400_in_the_callers_dialect(oai, claude, server) -> None:
    bad_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "format": "bogus"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=SMOL, messages=ask("x"), max_tokens=5, response_format=bad_format)
    assert caught.value.body["param"] == "response_format.json_schema.schema" and "bogus" in caught.value.message
    with pytest.raises(openai.BadRequestError, match="unevaluatedProperties"):
        oai.responses.create(model=SMOL, input="x", max_output_tokens=5, text={"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "object", "unevaluatedProperties": False}}})
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=SMOL, max_tokens=5, messages=ask("x"), extra_body={
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "integer", "minimum": "a"}}}})
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert "output_config.format.schema" in refused.value.body["error"]["message"]
    for extra, param in (({"regex": "a(b"}, "regex"), ({"grammar": "start: foo"}, "grammar"),
                         ({"regex": "a", "grammar": 'start: "a"'}, "regex")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as caught:
            oai.completions.create(model=SMOL, prompt="x", max_tokens=5, extra_body=extra)
        assert caught.value.body["param"] == param, caught.value.body
    with pytest.raises(openai.BadRequestError) as caught:  # a tool schema llguidance cannot hold
        oai.chat.completions.create(model=SMOL, messages=ask("x"), max_tokens=5, tool_choice="required", tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "unevaluatedProperties": False}}}])
    assert "unevaluatedProperties" in caught.value.message
    with pytest.raises(openai.BadRequestError, match="response_format.type"):
        oai.chat.completions.create(model=SMOL, messages=ask("x"), max_tokens=5, response_format={"type": "xml"})


def test_output_cut_by_max_tokens_is_never_presented_as_complete(oai, claude) -> None:
    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 200}}, "required": ["story"]}
    chat = oai.chat.completions.create(model=SMOL, messages=ask("Tell a story."), max_tokens=8, **GREEDY,
                                       response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert chat.choices[0].finish_reason == "length"
    resp = oai.responses.create(model=SMOL, input=ask("Tell a story."), max_output_tokens=8, **GREEDY,
                                text={"format": {"type": "json_schema", "name": "s", "schema": schema}})
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    msg = claude.messages.create(model=SMOL, max_tokens=8, messages=ask("Tell a story."), extra_body={
        **GREEDY, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert msg.stop_reason == "max_tokens"


def step_counts(server) -> dict:
    data = httpx.get(server.base_url + "/v1/models/status").json()["data"]
    return next(m for m in data if m["id"] == SMOL)["step_times"]


def test_eight_rows_half_constrained_share_decode_steps_and_match_each_alone(oai, server) -> None:
    """Greedy: a constrained row and a free one give, batched together, what each gives alone."""
    long = {"type": "object", "properties": {"story": {"type": "string", "minLength": 200}}, "required": ["story"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": long}}
    topics = ["the sea", "a cat", "the moon", "a robot", "a garden", "winter", "a train", "music"]

    def one(i: int) -> str:
        extra = {"response_format": fmt} if i % 2 else {"logit_bias": {"2": -100}}  # both run all 12 tokens
        r = oai.chat.completions.create(model=SMOL, messages=ask(f"Tell a story about {topics[i]}."), max_tokens=12,
                                        **GREEDY, **extra)
        assert r.usage.completion_tokens == 12
        return r.choices[0].message.content

    alone = [one(i) for i in range(8)]
    before = step_counts(server)
    with cf.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(one, range(8)))
    after = step_counts(server)
    assert together == alone
    assert all(text.startswith('{"story": "') for text in alone[1::2])
    loops, tokens = after["loops"] - before["loops"], after["tokens"] - before["tokens"]
    assert tokens / loops >= 6, (loops, tokens)  # decode steps shared by (nearly) all eight rows


def assert_args_valid(name: str, arguments: dict, tools: list[dict], key: str) -> None:
    schema = next(t[key] for t in tools if t["name"] == name)
    jsonschema.validate(arguments, schema)


def claude_code_call(claude, model: str, prompt: str, choice: dict) -> anthropic.types.ToolUseBlock:
    msg = claude.messages.create(model=model, max_tokens=120, system="You are a coding agent.", tools=CLAUDE_TOOLS,
                                 messages=[{"role": "user", "content": prompt}], tool_choice=choice, extra_body=GREEDY)
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(calls) == 1
    assert_args_valid(calls[0].name, calls[0].input, CLAUDE_TOOLS, "input_schema")
    return calls[0]


def codex_call(oai, model: str, prompt: str) -> None:
    resp = oai.responses.create(model=model, instructions="You are Codex, a coding agent.", input=prompt,
                                max_output_tokens=120, tools=CODEX_TOOLS, tool_choice="required", **GREEDY)
    calls = [o for o in resp.output if o.type == "function_call"]
    assert resp.status == "completed" and len(calls) == 1
    assert_args_valid(calls[0].name, json.loads(calls[0].arguments), CODEX_TOOLS, "parameters")


def test_forced_tool_calls_have_valid_arguments(oai, claude) -> None:
    """SmolLM2 (no tool template: the tools are described in its prompt, calls read as hermes)."""
    claude_code_call(claude, SMOL, "Run `ls -la` in the current directory.", {"type": "any"})
    named = claude_code_call(claude, SMOL, "Show me the file /etc/hostname.", {"type": "tool", "name": "Read"})
    assert named.name == "Read"
    codex_call(oai, SMOL, "Run `ls` in the shell.")
    chat_tools = [{"type": "function", "function": {"name": t["name"], "parameters": t["parameters"]}} for t in CODEX_TOOLS]
    chat = oai.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": "Run `pwd` in the shell."}],
                                       max_tokens=120, tools=chat_tools, **GREEDY,
                                       tool_choice={"type": "function", "function": {"name": "shell"}})
    assert chat.choices[0].finish_reason == "tool_calls"
    call = chat.choices[0].message.tool_calls[0].function
    assert call.name == "shell"
    assert_args_valid("shell", json.loads(call.arguments), CODEX_TOOLS, "parameters")


def test_forced_tool_calls_in_qwen_coders_own_template_have_valid_arguments(oai, claude) -> None:
    claude_code_call(claude, QWEN, "Run `ls -la` in the current directory.", {"type": "any"})
    codex_call(oai, QWEN, "Run `ls` in the shell.")


def test_thinking_budgets_force_the_end_of_reasoning_then_the_answer(oai, claude, server) -> None:
    think = [{"role": "user", "content": "Think, then answer."}]
    chat = oai.chat.completions.create(model=THINKER, messages=think, max_tokens=10, logprobs=True, **GREEDY,
                                       extra_body={"thinking_budget": 4})
    tokens = [t.token for t in chat.choices[0].logprobs.content]
    assert tokens.index("</think>") == 4  # four reasoning tokens, then the forced marker
    message = chat.choices[0].message
    reasoning, answer = message.model_extra["reasoning_content"], message.content
    assert reasoning and answer
    msg = claude.messages.create(model=THINKER, max_tokens=10, messages=think, extra_body=GREEDY,
                                 thinking={"type": "enabled", "budget_tokens": 4})
    assert [(b.type, getattr(b, "thinking", None) or b.text) for b in msg.content] == [
        ("thinking", reasoning), ("text", answer)]  # fmt: skip
    none = oai.chat.completions.create(model=THINKER, messages=think, max_tokens=4, logprobs=True, reasoning_effort="none",
                                       **GREEDY)
    assert none.choices[0].logprobs.content[0].token == "</think>"
    resp = oai.responses.create(model=THINKER, input="Think, then answer.", max_output_tokens=4, reasoning={"effort": "none"},
                                **GREEDY)
    assert [o.type for o in resp.output] == ["message"]
    # a budget of 0 is no reasoning at all: a model that would open a second block after the forced
    # end (here pushed to by a bias on <think>, the tiny tokenizer's id 3) may not
    again = oai.chat.completions.create(model=THINKER, messages=think, max_tokens=6, logprobs=True, **GREEDY,
                                        logit_bias={"3": 100}, extra_body={"thinking_budget": 0})
    tokens = [t.token for t in again.choices[0].logprobs.content]
    assert tokens[0] == "</think>" and "<think>" not in tokens, tokens
    assert not again.choices[0].message.model_extra.get("reasoning_content")
    schema = {"type": "object", "properties": {"ok": {"enum": ["yes", "no"]}}, "required": ["ok"]}
    held = oai.chat.completions.create(model=THINKER, messages=think, max_tokens=40, **GREEDY,
                                       response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
                                       extra_body={"thinking_budget": 3})
    assert held.choices[0].finish_reason == "stop" and held.choices[0].message.model_extra["reasoning_content"]
    jsonschema.validate(json.loads(held.choices[0].message.content), schema)  # the grammar starts after reasoning


def test_a_grammar_failing_mid_batch_fails_alone(server) -> None:
    """The other rows of the batch finish as they do alone; the failing one gets a 400 with
    llguidance's reason instead of text it could not hold to its grammar."""
    url = server.base_url + "/v1/completions"

    def complete(prompt: str, **extra) -> httpx.Response:
        body = {"model": NO_EOS, "prompt": prompt, "max_tokens": 160, **GREEDY, **extra}
        return httpx.post(url, json=body, timeout=600)

    prompts = ["The quick brown fox", "def add(a, b):", "Numbers like 12345"]
    alone = [complete(p).json()["choices"][0]["text"] for p in prompts]
    with cf.ThreadPoolExecutor(4) as pool:
        failing = pool.submit(complete, "What is", grammar=EXPLODING)
        together = [f.result().json()["choices"][0]["text"] for f in [pool.submit(complete, p) for p in prompts]]
        refused = failing.result()
    assert together == alone
    assert refused.status_code == 400, refused.text
    assert "structured output failed" in refused.json()["error"]["message"]
    assert "max is 2000" in refused.json()["error"]["message"]
