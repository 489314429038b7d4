"""Prefixes survive every turn of an agent session: 6 turns with tool calls and reasoning on tiny
reasoning models, through each API, sending back what the API returned as a client does.

With a template that renders past turns as they were (reasoning kept), every turn restores
at least the previous prompt and answer less one cache block: the server renders each earlier
answer as generated (text and token ids), whatever the client kept of it. With a Qwen3-style
template that drops past reasoning, every turn restores at least the previous prompt less one
block, and the log says the template rewrote the history.
"""

from __future__ import annotations

import json
import shutil

import anthropic
import openai
import pytest

from tests.support.server import ServerProcess
from tests.support.tiny_model import build_tiny_llama

KEEPS = "tiny-thinker-keeps"  # renders an assistant turn's content verbatim: reasoning stays
DROPS = "tiny-thinker-drops"  # Qwen3's rule: reasoning only after the last user message
BLOCK = 32
BUDGET = 6  # reasoning tokens before the end of thinking is forced
# Qwen3's handling of past reasoning, reduced to ChatML
QWEN3_STYLE = (
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{%- set content = m.content or '' %}"
    "{%- set reasoning = '' %}{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last %}{{ '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}"
    "{%- else %}{{ '<|im_start|>assistant\\n' + content }}{%- endif %}{{ '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]}},
          "required": ["city"]}  # fmt: skip
# (what the turn sends, whether the answer must be a call)
SCRIPT = [("user", True), ("tool", True), ("tool", False), ("user", True), ("tool", False), ("user", False)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix-models")
    build_tiny_llama(root / KEEPS, context=8192, thinking=True)
    build_tiny_llama(root / DROPS, context=8192, thinking=True)
    config = root / DROPS / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": QWEN3_STYLE}))
    home = tmp_path_factory.mktemp("prefix-home")
    srv = ServerProcess(home, ["--model-dir", str(root), "--cache-block-size", str(BLOCK), "--hot-cache-only"])
    srv.start()
    yield srv
    srv.stop()
    shutil.rmtree(home, ignore_errors=True)


def chat_session(server, model: str, reasons: list[str] | None = None) -> list[tuple[int, int, int]]:
    """(prompt, cached, completion) tokens per turn, over chat completions (each turn's cache
    reason, usage's `omlx.cache.reason`, appended to `reasons`)."""
    oai = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
    messages: list[dict] = [{"role": "system", "content": "You are an agent on chat completions."}]
    usage, last_call = [], None
    for k, (kind, call) in enumerate(SCRIPT):
        if kind == "user":
            messages.append({"role": "user", "content": f"Question {k}: the weather somewhere?"})
        else:
            messages.append({"role": "tool", "tool_call_id": last_call, "content": f"result {k}: sunny"})
        r = oai.chat.completions.create(
            model=model, messages=messages, tools=tools, tool_choice="required" if call else "auto",
            max_tokens=80, temperature=0, extra_body={"thinking_budget": BUDGET},
        )  # fmt: skip
        message = r.choices[0].message
        assert bool(message.tool_calls) == call, message
        sent = {"role": "assistant", "content": message.content}  # a client that drops reasoning_content
        if message.tool_calls:
            sent["tool_calls"] = [c.model_dump() for c in message.tool_calls]
            last_call = message.tool_calls[0].id
        messages.append(sent)
        usage.append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens, r.usage.completion_tokens))
        if reasons is not None:
            reasons.append(r.usage.model_extra["omlx"]["cache"]["reason"])
    return usage


def messages_session(server, model: str) -> list[tuple[int, int, int]]:
    """The same over Anthropic Messages: thinking, text and tool_use blocks sent back as returned."""
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="x", max_retries=0, timeout=120)
    tools = [{"name": "get_weather", "input_schema": PARAMS}]
    messages: list[dict] = []
    usage, last_call = [], None
    for k, (kind, call) in enumerate(SCRIPT):
        if kind == "user":
            messages.append({"role": "user", "content": f"Question {k}: the weather somewhere?"})
        else:
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": last_call, "content": f"result {k}: sunny"}]})
        m = claude.messages.create(
            model=model, system="You are an agent on Messages.", messages=messages, tools=tools, max_tokens=80,
            tool_choice={"type": "any"} if call else {"type": "auto"},
            thinking={"type": "enabled", "budget_tokens": BUDGET}, extra_body={"temperature": 0},
        )  # fmt: skip
        assert (m.stop_reason == "tool_use") == call, m
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]})
        last_call = next((b.id for b in m.content if b.type == "tool_use"), last_call)
        u = m.usage
        usage.append((u.input_tokens + u.cache_read_input_tokens, u.cache_read_input_tokens, u.output_tokens))
    return usage


def responses_session(server, model: str) -> list[tuple[int, int, int]]:
    """The same over Responses, as Codex sends it: store false, the whole history as items,
    reasoning items included."""
    oai = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    tools = [{"type": "function", "name": "get_weather", "parameters": PARAMS}]
    items: list[dict] = []
    usage, last_call = [], None
    for k, (kind, call) in enumerate(SCRIPT):
        if kind == "user":
            items.append({"type": "message", "role": "user", "content": f"Question {k}: the weather somewhere?"})
        else:
            items.append({"type": "function_call_output", "call_id": last_call, "output": f"result {k}: sunny"})
        r = oai.responses.create(
            model=model, instructions="You are an agent on Responses.", input=items, tools=tools, store=False,
            tool_choice="required" if call else "auto", max_output_tokens=80, temperature=0,
            extra_body={"thinking_budget": BUDGET},
        )  # fmt: skip
        calls = [o for o in r.output if o.type == "function_call"]
        assert bool(calls) == call, r.output
        items += [o.model_dump(exclude_none=True) for o in r.output]
        last_call = calls[0].call_id if calls else last_call
        usage.append((r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens, r.usage.output_tokens))
    return usage


@pytest.mark.parametrize("session", [chat_session, messages_session, responses_session])
def test_a_template_that_keeps_reasoning_restores_every_previous_prompt_and_answer(server, session):
    usage = session(server, KEEPS)
    assert usage[0][1] < usage[0][0] / 2, usage  # each session has a prompt of its own
    for k in range(1, len(usage)):
        prompt, completion = usage[k - 1][0], usage[k - 1][2]
        assert usage[k][1] >= prompt + completion - BLOCK, (k, usage)


def test_a_template_that_drops_past_reasoning_restores_every_previous_prompt_and_says_why(server):
    reasons: list[str] = []
    usage = chat_session(server, DROPS, reasons)
    for k in range(1, len(usage)):
        assert usage[k][1] >= usage[k - 1][0] - BLOCK, (k, usage)
    assert "the chat template rewrote" in server.log()
    # where the restore ends early, the usage names the template, never a bare `diverged`
    assert "template" in reasons[1:] and "diverged" not in reasons, reasons
