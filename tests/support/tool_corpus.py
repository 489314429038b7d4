"""The tool-call corpus: for every family, what its documented format looks like when all goes
well and when it does not (several calls, arguments that are not JSON, an envelope left open,
a marker quoted in prose or code), with what each API must make of it.

`expected` lists the parsed items in order: ("text", str), ("reasoning", str), ("call", name,
arguments) with arguments a dict, or the arguments' text as generated when they are not a JSON
object. `finish` is how generation ended (the engine's reason), `warnings` the codes expected.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string"}, "days": {"type": "integer"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Current time.", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {
        "name": "search", "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer"}}}}},
]  # fmt: skip
CAPTURED = Path(__file__).resolve().parent.parent / "unit" / "corpus" / "tool_outputs_captured.json"


@dataclass
class Case:
    id: str
    family: str | None
    text: str
    expected: list[tuple]
    warnings: list[str] = field(default_factory=list)
    finish: str = "stop"  # how generation ended
    tools: list[dict[str, Any]] = field(default_factory=lambda: TOOLS)

    @property
    def api_finish(self) -> str:
        """The finish an API reports: calls make it `tool_calls`."""
        return "tool_calls" if any(item[0] == "call" for item in self.expected) else self.finish


def call(name: str, args: dict[str, Any] | str | None = None) -> tuple:
    return ("call", name, {} if args is None else args)


def text(value: str) -> tuple:
    return ("text", value)


def _verbatim(case_id: str, family: str | None, value: str, warnings: list[str] | None = None,
              finish: str = "stop") -> Case:
    return Case(case_id, family, value, [text(value)], warnings or [], finish)


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>'
SYNTHETIC: list[Case] = [
    # --- hermes: Qwen2.5 / Qwen3 / Hermes, and the prompt of templates without tools
    Case("hermes-one", "hermes", HERMES_CALL, [call("get_weather", {"location": "Paris"})]),
    Case("hermes-text-then-three-in-order", "hermes",
         "Checking three things.\n" + HERMES_CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
         '\n<tool_call>\n{"name": "search", "arguments": {"query": "mlx", "limit": 3}}\n</tool_call>',
         [text("Checking three things."), call("get_weather", {"location": "Paris"}), call("get_time"),
          call("search", {"query": "mlx", "limit": 3})]),
    Case("hermes-invalid-arguments", "hermes",
         '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris",, "days": 2}}\n</tool_call>',
         [call("get_weather", '{"location": "Paris",, "days": 2}')], ["tool_arguments_invalid"]),
    Case("hermes-unclosed-but-complete", "hermes", '<tool_call>\n{"name": "get_time", "arguments": {}}',
         [call("get_time")]),
    _verbatim("hermes-cut-inside-a-call", "hermes",
              'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"loca', ["tool_call_unclosed"], "length"),
    _verbatim("hermes-unreadable-call", "hermes", '<tool_call>\n{"nam": "get_time"}\n</tool_call>', ["tool_call_unparsed"]),
    _verbatim("hermes-marker-in-prose", "hermes",
              "Wrap each call in a <tool_call> tag and close it with </tool_call>. That is all there is to it."),
    _verbatim("hermes-marker-in-inline-code", "hermes",
              'Use `<tool_call>` tags, as in `<tool_call>{"name": "get_time"}</tool_call>`, then stop.'),
    _verbatim("hermes-marker-in-code-block", "hermes",
              'The format:\n```xml\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n```\nThat is it.'),
    Case("hermes-quoted-marker-then-a-call", "hermes",
         "The <tool_call> tag wraps calls; here is one:\n" + HERMES_CALL,
         [text("The <tool_call> tag wraps calls; here is one:"), call("get_weather", {"location": "Paris"})]),
    # --- qwen3_coder
    Case("qwen3-coder-one", "qwen3_coder",
         "<tool_call>\n<function=get_weather>\n<parameter=location>\nSan Francisco, CA\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
         [call("get_weather", {"location": "San Francisco, CA", "days": 3})]),
    Case("qwen3-coder-text-then-two", "qwen3_coder",
         "Let me look.\n\n<tool_call>\n<function=search>\n<parameter=query>\nline one\nline two\n</parameter>\n"
         "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
         [text("Let me look."), call("search", {"query": "line one\nline two"}), call("get_time")]),
    Case("qwen3-coder-json-invalid-arguments", "qwen3_coder",
         '<tool_call>\n{"name": "search", "arguments": {"query": "mlx" "limit": 3}}\n</tool_call>',
         [call("search", '{"query": "mlx" "limit": 3}')], ["tool_arguments_invalid"]),
    Case("qwen3-coder-unclosed-but-complete", "qwen3_coder", "<tool_call>\n<function=get_time>\n</function>",
         [call("get_time")]),
    _verbatim("qwen3-coder-cut-inside-a-call", "qwen3_coder",
              "<tool_call>\n<function=get_weather>\n<parameter=location>\nPar", ["tool_call_unclosed"], "length"),
    _verbatim("qwen3-coder-marker-in-prose", "qwen3_coder", "Write <function= followed by the name, then the body."),
    # --- glm
    Case("glm45-reasoning-then-call", "glm",
         "<think>The user asks about Beijing.</think>\n<tool_call>get_weather\n<arg_key>location</arg_key>\n"
         "<arg_value>Beijing</arg_value>\n</tool_call>",
         [("reasoning", "The user asks about Beijing."), call("get_weather", {"location": "Beijing"})]),
    Case("glm47-two", "glm",
         "<tool_call>get_weather<arg_key>location</arg_key><arg_value>Oslo</arg_value></tool_call>"
         "<tool_call>get_time</tool_call>",
         [call("get_weather", {"location": "Oslo"}), call("get_time")]),
    Case("glm-invalid-arguments", "glm", '<tool_call>get_weather\n{"location": Oslo}</tool_call>',
         [call("get_weather", '{"location": Oslo}')], ["tool_arguments_invalid"]),
    _verbatim("glm-marker-in-prose", "glm", "GLM wraps its calls in <tool_call> tags. It works well."),
    # --- llama3
    Case("llama3-json", "llama3", '{"name": "get_weather", "parameters": {"location": "Paris", "unit": "celsius"}}',
         [call("get_weather", {"location": "Paris", "unit": "celsius"})]),
    Case("llama3-python-tag-two", "llama3",
         '<|python_tag|>{"name": "get_weather", "parameters": {"location": "Paris"}}; {"name": "get_time", "parameters": {}}',
         [call("get_weather", {"location": "Paris"}), call("get_time")]),
    Case("llama3-invalid-arguments", "llama3", '<|python_tag|>{"name": "get_weather", "parameters": {"location": Paris}}',
         [call("get_weather", '{"location": Paris}')], ["tool_arguments_invalid"]),
    Case("llama3-bare-invalid-arguments", "llama3", '{"name": "get_weather", "parameters": {"location": Paris}}',
         [call("get_weather", '{"location": Paris}')], ["tool_arguments_invalid"]),
    # --- mistral
    Case("mistral-v3-json", "mistral",
         '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"location": "Paris"}, "id": "a1b2c3d4e"}]',
         [call("get_weather", {"location": "Paris"})]),
    Case("mistral-args-two", "mistral", '[TOOL_CALLS]get_weather[ARGS]{"location": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
         [call("get_weather", {"location": "Paris"}), call("get_time")]),
    Case("mistral-invalid-arguments", "mistral", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"location": "Paris"',
         [text("Checking."), call("get_weather", '{"location": "Paris"')], ["tool_arguments_invalid"]),
    _verbatim("mistral-marker-in-prose", "mistral", "The [TOOL_CALLS] token starts a call in this format."),
    # --- gemma: Gemma 4, FunctionGemma, Gemma 3's tool_code fence
    Case("gemma4-two", "gemma",
         '<|tool_call>call:get_weather{location:<|"|>Paris, France<|"|>,days:2}<tool_call|>'
         "<|tool_call>call:get_time{}<tool_call|>",
         [call("get_weather", {"location": "Paris, France", "days": 2}), call("get_time")]),
    Case("function-gemma", "gemma", "<start_function_call>call:get_weather{location:<escape>London<escape>}<end_function_call>",
         [call("get_weather", {"location": "London"})]),
    Case("gemma3-tool-code", "gemma", 'Let me check.\n```tool_code\nget_weather(location="Paris", days=3)\n```',
         [text("Let me check."), call("get_weather", {"location": "Paris", "days": 3})]),
    _verbatim("gemma4-cut-inside-a-call", "gemma", '<|tool_call>call:get_weather{location:<|"|>Par',
              ["tool_call_unclosed"], "length"),
    _verbatim("gemma-marker-in-prose", "gemma", "Gemma writes <start_function_call> before each call it makes."),
    # --- deepseek
    Case("deepseek-v3-r1", "deepseek",
         "<think>\nNeed weather.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
         '```json\n{"location": "Tokyo", "unit": "celsius"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
         [("reasoning", "Need weather."), call("get_weather", {"location": "Tokyo", "unit": "celsius"})]),
    Case("deepseek-v31-two", "deepseek",
         'Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"location": "Tokyo"}'
         "<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
         [text("Let me check."), call("get_weather", {"location": "Tokyo"}), call("get_time")]),
    Case("deepseek-invalid-arguments", "deepseek",
         '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"location": Tokyo}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
         [call("get_weather", '{"location": Tokyo}')], ["tool_arguments_invalid"]),
    Case("deepseek-unclosed-but-complete", "deepseek",
         "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜>", [call("get_time")]),
    Case("deepseek-v32-dsml", "deepseek",
         '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
         '<｜DSML｜parameter name="location" string="true">杭州</｜DSML｜parameter>\n'
         '<｜DSML｜parameter name="days" string="false">5</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>',
         [call("get_weather", {"location": "杭州", "days": 5})]),
    # --- kimi k2
    Case("kimi-k2-two", "kimi_k2",
         "I'll check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
         '{"location": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}'
         "<|tool_call_end|><|tool_calls_section_end|>",
         [text("I'll check."), call("get_weather", {"location": "Paris"}), call("get_time")]),
    Case("kimi-k2-invalid-arguments", "kimi_k2",
         "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
         '{"location": Paris}<|tool_call_end|><|tool_calls_section_end|>',
         [call("get_weather", '{"location": Paris}')], ["tool_arguments_invalid"]),
    _verbatim("kimi-k2-cut-inside-a-call", "kimi_k2",
              "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
              '{"loca', ["tool_call_unclosed"], "length"),
    # --- families only mlx-lm knows
    Case("mlx-pythonic", "pythonic", 'Sure.<|tool_call_start|>[get_weather(location="Paris", days=2)]<|tool_call_end|>',
         [text("Sure."), call("get_weather", {"location": "Paris", "days": 2})]),
    Case("mlx-minimax-m2", "minimax_m2",
         '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="location">Rome</parameter>\n</invoke>\n'
         "</minimax:tool_call>",
         [call("get_weather", {"location": "Rome"})]),
    # --- the fallbacks of small models: bare JSON and fenced JSON (any family, tools offered)
    Case("bare-json", None, '  {"name": "get_weather", "arguments": {"location": "Paris"}}\n',
         [call("get_weather", {"location": "Paris"})]),
    Case("bare-json-list", None,
         '[{"name": "get_weather", "parameters": {"location": "Paris"}}, {"name": "get_time", "arguments": null}]',
         [call("get_weather", {"location": "Paris"}), call("get_time")]),
    Case("fenced-json", "hermes",
         'Here is the call:\n```json\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n```\nDone.',
         [text("Here is the call:"), call("get_weather", {"location": "Paris"}), text("Done.")]),
    Case("bare-json-invalid-arguments", None, '{"name": "get_weather", "arguments": {"location": "Paris",, }}',
         [call("get_weather", '{"location": "Paris",, }')], ["tool_arguments_invalid"]),
    Case("fenced-json-invalid-arguments", "hermes",
         '```json\n{"name": "get_weather", "arguments": {location: Paris}}\n```',
         [call("get_weather", "{location: Paris}")], ["tool_arguments_invalid"]),
    _verbatim("bare-json-cut-inside-a-call", None, '{"name": "get_weather", "arguments": {"loc',
              ["tool_call_unclosed"], "length"),
    # a call fence left open (or its closing backticks cut short) at the end is closed when its body is a call
    Case("fenced-json-closing-fence-cut", "hermes",
         '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "location": "Paris"\n  }\n}\n`',
         [call("get_weather", {"location": "Paris"})]),
    Case("fenced-json-never-closed", "hermes", 'Calling it.\n```json\n{"name": "get_time", "arguments": {}}\n',
         [text("Calling it."), call("get_time")]),
    _verbatim("fenced-json-cut-inside-a-call", "hermes", '```json\n{"name": "get_weather", "arguments": {"loc',
              ["tool_call_unclosed"], "length"),
    _verbatim("json-answer-is-not-a-call", "hermes", '{"city": "Paris", "temp": 21}'),
    # a call beyond doubt of a tool that was not offered is still a call: the client tells the model
    Case("call-of-a-tool-not-offered", "hermes", '```json\n{"name": "read_readme", "arguments": {}}\n```',
         [call("read_readme")], ["tool_call_unknown_tool"]),
    Case("bare-call-of-a-tool-not-offered", None, '{"name": "add", "arguments": {"a": 2, "b": 3}}',
         [call("add", {"a": 2, "b": 3})], ["tool_call_unknown_tool"]),
    Case("call-of-a-tool-not-offered-by-a-description", "hermes",
         '```json\n{\n  "name": "Read greet.py",\n  "arguments": {\n    "filePath": "/repo/greet.py"\n  }\n}\n```\n',
         [call("Read greet.py", {"filePath": "/repo/greet.py"})], ["tool_call_unknown_tool"]),
    _verbatim("unknown-name-json-with-other-keys-is-text", "hermes",
              '{"name": "add", "arguments": {"a": 2}, "description": "adds"}'),
    _verbatim("unknown-name-json-with-list-arguments-is-text", None, '{"name": "Ada", "arguments": ["x", "y"]}'),
]  # fmt: skip


def captured_cases() -> list[Case]:
    """The real outputs of Qwen2.5-Coder-0.5B and SmolLM2-135M (tests/support/capture_tool_outputs.py)."""
    data = json.loads(CAPTURED.read_text())
    cases = []
    for entry in data["entries"]:
        exp = entry["expected"]
        items: list[tuple] = []
        for name, args in exp["calls"]:
            try:
                value = json.loads(args)
            except ValueError:
                value = args
            items.append(call(name, value if isinstance(value, dict) else args))
        if exp["text"]:  # these outputs hold either text or calls (a mix would need its order written down)
            assert not items, entry
            items.append(text(exp["text"]))
        cases.append(Case(f"{entry['model']}-{entry['prompt']}-{entry['setting']}", entry["family"], entry["output"],
                          items, list(exp["warnings"]), tools=data["tools"]))  # fmt: skip
    return cases


def chunkings(value: str) -> list[list[str]]:
    """The text whole, character by character, and in four random splits (seeded by its length)."""
    rng = random.Random(len(value))
    out = [[value], list(value)]
    for _ in range(4):
        pieces, i = [], 0
        while i < len(value):
            n = rng.randint(1, 9)
            pieces.append(value[i : i + n])
            i += n
        out.append(pieces)
    return out
