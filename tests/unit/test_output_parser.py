"""Output parser: reasoning / text / tool-call deltas from streamed model output."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest

from omlx.api.output_parser import OutputParser, parse_output
from omlx.api.tool_call_formats import canonical_family, detect_family, prompt_opens_reasoning
from omlx.api.tool_calls import TextDelta, ToolCall, call_arguments, normalize_arguments
from omlx.api.tool_prompt import inject_tools_into_system, template_supports_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time.",
        "parameters": {"type": "object", "properties": {}},
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
        },
    },
}
TOOLS = [WEATHER, TIME, SEARCH]

# Every marker a family prints; none may show up in a TextDelta of a successful parse.
MARKUP = [
    "<tool_call>",
    "</tool_call>",
    "<function=",
    "</function>",
    "<parameter=",
    "<arg_key>",
    "<arg_value>",
    "<|python_tag|>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "<|tool_call>",
    "<tool_call|>",
    '<|"|>',
    "<start_function_call>",
    "<end_function_call>",
    "<escape>",
    "tool▁call",
    "tool▁sep",
    "｜DSML｜",
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_start|>",
    "<think>",
    "</think>",
]


def chunkings(text: str) -> list[list[str]]:
    rng = random.Random(len(text))
    out = [[text], list(text)]
    for _ in range(4):
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 9)
            pieces.append(text[i : i + n])
            i += n
        out.append(pieces)
    return out


def run(pieces: list[str], **kw) -> tuple[list, OutputParser]:
    parser = OutputParser(**kw)
    deltas = []
    for piece in pieces:
        deltas += parser.feed(piece)
    deltas += parser.finish()
    return deltas, parser


def summary(deltas: list) -> list:
    """Adjacent text/reasoning deltas merged; calls as (name, decoded arguments)."""
    out: list = []
    for d in deltas:
        if isinstance(d, ToolCall):
            assert d.id.startswith("call_") and len(d.id) == 29
            if d.problem:  # arguments as generated
                out.append(("call", d.name, d.arguments))
                continue
            args = json.loads(d.arguments)
            assert isinstance(args, dict), d.arguments
            out.append(("call", d.name, args))
        else:
            kind = "text" if isinstance(d, TextDelta) else "reasoning"
            assert d.text, "empty delta"
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + d.text)
            else:
                out.append((kind, d.text))
    return out


def check(text: str, expected: list, *, markup_free: bool = True, **kw) -> None:
    kw.setdefault("tools", TOOLS)
    kw.setdefault("reasoning", True)
    for pieces in chunkings(text):
        deltas, parser = run(pieces, **kw)
        got = summary(deltas)
        assert got == expected, (pieces[:5], got)
        calls = [d for d in deltas if isinstance(d, ToolCall)]
        assert [c.id for c in parser.tool_calls] == [c.id for c in calls]
        if markup_free:
            for d in deltas:
                if isinstance(d, TextDelta):
                    assert not any(m in d.text for m in MARKUP), d.text


def call(name: str, **args) -> tuple:
    return ("call", name, args)


# --------------------------------------------------------------------------- per family

CASES = [
    # --- hermes: Qwen2.5 / Qwen3 / Hermes
    pytest.param(
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>',
        [call("get_weather", location="Paris")],
        id="hermes-single",
    ),
    pytest.param(
        "hermes",
        'I\'ll check both cities.\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", "days": 2}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "Tokyo"}}\n</tool_call>',
        [
            ("text", "I'll check both cities."),
            call("get_weather", location="Paris", days=2),
            call("get_weather", location="Tokyo"),
        ],
        id="hermes-text-and-two-calls",
    ),
    pytest.param(
        "hermes",
        "<think>\nThe user wants the weather in Paris. I should call get_weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>',
        [
            ("reasoning", "The user wants the weather in Paris. I should call get_weather."),
            call("get_weather", location="Paris"),
        ],
        id="qwen3-thinking-then-call",
    ),
    pytest.param(
        "hermes",
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n\nDone, now waiting.',
        [call("get_time"), ("text", "Done, now waiting.")],
        id="hermes-text-after",
    ),
    pytest.param(
        "hermes",
        '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"mlx\\", \\"limit\\": 3}"}\n</tool_call>',
        [call("search", query="mlx", limit=3)],
        id="hermes-arguments-as-json-string",
    ),
    pytest.param(
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n<tool_call>\n'
        '{"name": "get_time", "arguments": {}}\n</tool_call>',
        [call("get_weather", location="Paris"), call("get_time")],
        id="hermes-missing-close-tag",
    ),
    # --- qwen3_coder
    pytest.param(
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=location>\nSan Francisco, CA\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        [call("get_weather", location="San Francisco, CA", days=3)],
        id="qwen3-coder",
    ),
    pytest.param(
        "qwen3_coder",
        "Let me look.\n\n<tool_call>\n<function=search>\n<parameter=query>\nline one\nline two\n</parameter>\n</function>\n"
        "</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        [("text", "Let me look."), call("search", query="line one\nline two"), call("get_time")],
        id="qwen3-coder-two-calls-multiline",
    ),
    pytest.param(
        "qwen3_coder",
        "<function=get_weather>\n<parameter=location>\nOslo\n</parameter>\n</function>",
        [call("get_weather", location="Oslo")],
        id="qwen3-coder-without-wrapper",
    ),
    # --- glm
    pytest.param(
        "glm",
        "<think>The user asks about Beijing.</think>\n<tool_call>get_weather\n<arg_key>location</arg_key>\n"
        "<arg_value>Beijing</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
        [
            ("reasoning", "The user asks about Beijing."),
            call("get_weather", location="Beijing", days=2),
        ],
        id="glm45",
    ),
    pytest.param(
        "glm",
        "<tool_call>get_weather<arg_key>location</arg_key><arg_value>Beijing</arg_value></tool_call>"
        "<tool_call>get_time</tool_call>",
        [call("get_weather", location="Beijing"), call("get_time")],
        id="glm47-and-no-args",
    ),
    # --- llama3
    pytest.param(
        "llama3",
        '{"name": "get_weather", "parameters": {"location": "Paris", "unit": "celsius"}}',
        [call("get_weather", location="Paris", unit="celsius")],
        id="llama3-json",
    ),
    pytest.param(
        "llama3",
        '<|python_tag|>{"name": "get_weather", "parameters": {"location": "Paris"}}',
        [call("get_weather", location="Paris")],
        id="llama3-python-tag",
    ),
    pytest.param(
        "llama3",
        '{"name": "get_weather", "parameters": {"location": "Paris"}}; {"name": "get_time", "parameters": {}}',
        [call("get_weather", location="Paris"), call("get_time")],
        id="llama3-two-calls",
    ),
    pytest.param(
        "llama3",
        '<|python_tag|>brave_search.call(query="weather in Paris")',
        [call("brave_search", query="weather in Paris")],
        id="llama3-builtin",
    ),
    # --- mistral
    pytest.param(
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"location": "Paris"}, "id": "a1b2c3d4e"}]',
        [call("get_weather", location="Paris")],
        id="mistral-v3-json",
    ),
    pytest.param(
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"location": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        [call("get_weather", location="Paris"), call("get_time")],
        id="mistral-args",
    ),
    pytest.param(
        "mistral",
        'Checking.[TOOL_CALLS]get_weather[CALL_ID]Ab3dE6gh9[ARGS]{"location": "Lyon", "days": 1}',
        [("text", "Checking."), call("get_weather", location="Lyon", days=1)],
        id="mistral-small-32-call-id",
    ),
    # --- gemma
    pytest.param(
        "gemma",
        '<|tool_call>call:get_weather{location:<|"|>Paris, France<|"|>,days:2}<tool_call|>',
        [call("get_weather", location="Paris, France", days=2)],
        id="gemma4",
    ),
    pytest.param(
        "gemma",
        "<start_function_call>call:get_weather{location:<escape>London<escape>}<end_function_call>",
        [call("get_weather", location="London")],
        id="function-gemma",
    ),
    pytest.param(
        "gemma",
        'Let me check.\n```tool_code\nget_weather(location="Paris", days=3)\n```',
        [("text", "Let me check."), call("get_weather", location="Paris", days=3)],
        id="gemma3-tool-code",
    ),
    # --- deepseek
    pytest.param(
        "deepseek",
        "<think>\nNeed weather.\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"location": "Tokyo", "unit": "celsius"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        [("reasoning", "Need weather."), call("get_weather", location="Tokyo", unit="celsius")],
        id="deepseek-v3-r1",
    ),
    pytest.param(
        "deepseek",
        'Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"location": "Tokyo"}'
        "<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        [("text", "Let me check."), call("get_weather", location="Tokyo"), call("get_time")],
        id="deepseek-v31",
    ),
    pytest.param(
        "deepseek",
        '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="location" string="true">杭州</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">5</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜function_calls>",
        [call("get_weather", location="杭州", days=5)],
        id="deepseek-v32-dsml",
    ),
    # --- kimi k2
    pytest.param(
        "kimi_k2",
        "I'll check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"location": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}'
        "<|tool_call_end|><|tool_calls_section_end|>",
        [("text", "I'll check."), call("get_weather", location="Paris"), call("get_time")],
        id="kimi-k2",
    ),
    # --- a family only mlx-lm knows (LFM2's pythonic format)
    pytest.param(
        "pythonic",
        'Sure.<|tool_call_start|>[get_weather(location="Paris", days=2)]<|tool_call_end|>',
        [("text", "Sure."), call("get_weather", location="Paris", days=2)],
        id="mlx-pythonic",
    ),
]


@pytest.mark.parametrize("family,text,expected", CASES)
def test_family_formats(family, text, expected):
    check(text, expected, family=family)


def test_model_ids_are_kept_aside():
    out = parse_output(
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        '{"location": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
        family="kimi_k2",
        tools=TOOLS,
        reasoning=False,
    )
    assert out.tool_calls[0].model_id == "functions.get_weather:0"
    assert out.tool_calls[0].id.startswith("call_")
    out = parse_output(
        '[TOOL_CALLS]get_weather[CALL_ID]Ab3dE6gh9[ARGS]{"location": "Lyon"}',
        family="mistral",
        tools=TOOLS,
        reasoning=False,
    )
    assert out.tool_calls[0].model_id == "Ab3dE6gh9"
    ids = {
        c.id
        for c in parse_output(
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
            family="hermes",
            tools=TOOLS,
            reasoning=False,
        ).tool_calls
    }
    assert len(ids) == 2


# --------------------------------------------------------------------------- small-model fallbacks


@pytest.mark.parametrize("family", [None, "hermes", "llama3", "qwen3_coder"])
def test_bare_json_call_with_tools(family):
    check(
        '  {"name": "get_weather", "arguments": {"location": "Paris"}}\n',
        [call("get_weather", location="Paris")],
        family=family,
    )


def test_bare_json_list_and_parameters_key():
    check(
        '[{"name": "get_weather", "parameters": {"location": "Paris"}}, {"name": "get_time", "arguments": null}]',
        [call("get_weather", location="Paris"), call("get_time")],
        family=None,
    )


def test_bare_json_python_style_quotes():
    check(
        "{'name': 'get_weather', 'arguments': {'location': 'Paris'}}",
        [call("get_weather", location="Paris")],
        family=None,
    )


def test_bare_json_after_reasoning_and_text_after():
    check(
        '<think>Use the tool.</think>\n{"name": "get_time", "arguments": {}}\nOne moment.',
        [("reasoning", "Use the tool."), call("get_time"), ("text", "One moment.")],
        family="hermes",
    )


def test_bare_json_without_tools_is_text():
    text = '{"name": "get_weather", "arguments": {"location": "Paris"}}'
    check(text, [("text", text)], family="hermes", tools=None, markup_free=False)


def test_a_call_of_a_tool_not_offered_is_a_call_with_a_warning():
    """Returned as a call, the client reports the unknown tool to the model and the agent loop
    goes on; as text it would end the turn, the JSON as the answer."""
    text = '{"name": "launch_rockets", "arguments": {"count": 3}}'
    check(text, [call("launch_rockets", count=3)], family=None)
    check("Example:\n```json\n" + text + "\n```\nEnd.", [("text", "Example:"), call("launch_rockets", count=3),
          ("text", "End.")], family=None)  # fmt: skip
    parsed = parse_output(text, family=None, tools=TOOLS, reasoning=False)
    assert [w.code for w in parsed.warnings] == ["tool_call_unknown_tool"]


def test_unknown_names_are_calls_only_when_strictly_call_shaped_and_no_format_was_asked():
    for text in [
        '{"name": "launch_rockets", "arguments": {"count": 3}, "note": "x"}',  # a key no call has
        '{"name": "Ada", "arguments": ["x"]}',  # arguments neither object nor JSON text
        '{"name": "Ada", "arguments": {}, "parameters": {}}',
        '[{"name": "a", "arguments": {}}, {"city": "Paris"}]',
    ]:
        check(text, [("text", text)], family=None)
    text = '{"name": "launch_rockets", "arguments": {"count": 3}}'
    check(text, [("text", text)], family=None, unknown_tool_calls=False)


def test_json_answer_that_is_not_a_call_is_text():
    for text in [
        '{"city": "Paris", "temp": 21}',
        '{"name": "Alice", "age": 30}',
        "[1, 2, 3] are numbers",
        "{this is not json} ok",
        "[link](http://x)",
    ]:
        check(text, [("text", text)], family="hermes")


def test_echoed_tool_definition_is_not_a_call():
    text = json.dumps(WEATHER["function"])
    check(text, [("text", text)], family="llama3")


@pytest.mark.parametrize("fence", ["```json", "```", "```tool_call"])
def test_fenced_json_call(fence):
    text = f'Here is the call:\n{fence}\n{{"name": "get_weather", "arguments": {{"location": "Paris"}}}}\n```\nDone.'
    check(
        text,
        [("text", "Here is the call:"), call("get_weather", location="Paris"), ("text", "Done.")],
        family=None,
    )


def test_fenced_whole_output_and_list():
    check(
        '```json\n[{"name": "get_weather", "arguments": {"location": "Paris"}}, {"name": "get_time", "arguments": {}}]\n```',
        [call("get_weather", location="Paris"), call("get_time")],
        family="hermes",
    )


def test_native_markup_inside_a_fence():
    check(
        'Calling:\n```json\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n```\nok',
        [("text", "Calling:"), call("get_time"), ("text", "ok")],
        family="hermes",
    )


def test_stray_closing_brace_after_call():
    check(
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}}\n</tool_call>',
        [call("get_weather", location="Paris")],
        family="hermes",
    )
    check(
        '{"name": "get_weather", "arguments": {"location": "Paris"}}}',
        [call("get_weather", location="Paris")],
        family=None,
    )


def test_fenced_json_not_a_call_is_verbatim_text():
    for text in [
        'Data:\n```json\n{"a": 1}\n```',
        "Code:\n```python\nprint('hi')\n```\nAnd ```json\n{\"b\": 2}\n``` too",
    ]:
        check(text, [("text", text)], family=None)


def test_fenced_json_without_tools_is_text():
    text = '```json\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n```'
    check(text, [("text", text)], family=None, tools=None)


def test_code_block_streams_before_it_closes():
    parser = OutputParser(family=None, tools=TOOLS, reasoning=False)
    got = parser.feed("Sure:\n```python\nimport os\nprint(os.getcwd())\n")
    assert "".join(d.text for d in got) == "Sure:\n```python\nimport os\nprint(os.getcwd())"


# --------------------------------------------------------------------------- reasoning


def test_reasoning_split():
    check(
        "<think>\nStep 1.\nStep 2.\n</think>\n\nThe answer is 4.",
        [("reasoning", "Step 1.\nStep 2."), ("text", "The answer is 4.")],
        family="hermes",
    )


def test_starts_in_reasoning():
    check(
        "Thinking about it.\n</think>\n\nHello!",
        [("reasoning", "Thinking about it."), ("text", "Hello!")],
        family="hermes",
        starts_in_reasoning=True,
    )


def test_starts_in_reasoning_but_model_repeats_open_tag():
    check(
        "<think>\nHmm.</think>Hi",
        [("reasoning", "Hmm."), ("text", "Hi")],
        family="hermes",
        starts_in_reasoning=True,
    )


def test_reasoning_disabled_keeps_think_as_text():
    text = "<think>x</think>y"
    check(text, [("text", text)], family="hermes", reasoning=False, markup_free=False)


def test_truncated_inside_reasoning():
    check("<think>I was cut off mid", [("reasoning", "I was cut off mid")], family="hermes")


def test_tool_markup_inside_reasoning_is_not_parsed():
    check(
        '<think>I could emit <tool_call>{"name": "get_time", "arguments": {}}</tool_call> now.</think>'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        [
            (
                "reasoning",
                'I could emit <tool_call>{"name": "get_time", "arguments": {}}</tool_call> now.',
            ),
            call("get_time"),
        ],
        family="hermes",
    )


def test_custom_think_markers():
    check(
        "<|channel>thought\nPlan.<channel|>Answer.",
        [("reasoning", "Plan."), ("text", "Answer.")],
        family="gemma",
        think_start="<|channel>thought",
        think_end="<channel|>",
    )


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


# --------------------------------------------------------------------------- streaming behaviour


def test_marker_prefix_is_held_back_then_released():
    parser = OutputParser(family="hermes", tools=TOOLS, reasoning=True)
    assert parser.feed("Hello <tool") == [TextDelta("Hello")]
    assert parser.feed("box> world") == [TextDelta(" <toolbox> world")]
    assert parser.finish() == []


def test_text_before_call_is_streamed_before_the_call_ends():
    parser = OutputParser(family="hermes", tools=TOOLS, reasoning=False)
    first = parser.feed('Checking the weather now.\n<tool_call>\n{"name": "get_weather", "argu')
    assert first == [TextDelta("Checking the weather now.")]
    rest = parser.feed('ments": {"location": "Paris"}}\n</tool_call>')
    assert len(rest) == 1 and isinstance(rest[0], ToolCall)
    assert parser.finish() == []


def test_plain_text_is_not_delayed():
    for tools in (None, TOOLS):
        parser = OutputParser(family="hermes", tools=tools, reasoning=True)
        assert parser.feed("The capital of France") == [TextDelta("The capital of France")]
        assert parser.feed(" is Paris.") == [TextDelta(" is Paris.")]
        assert parser.finish() == []


def test_truncated_call_comes_back_as_text():
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"loca'
    check(text, [("text", text)], family="hermes", markup_free=False)


def test_unparseable_closed_call_comes_back_as_text():
    text = "<tool_call>not json at all</tool_call> ok"
    check(text, [("text", text)], family="hermes", markup_free=False)


def test_no_tools_means_no_call_parsing():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    check(text, [("text", text)], family="hermes", tools=None, markup_free=False)


def test_plain_text_whitespace_preserved():
    text = "  Line one.\n\n  Line two.\n"
    check(text, [("text", text)], family="hermes")
    check(text, [("text", text)], family="hermes", tools=None)


FUZZ_ATOMS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    '{"name": "get_time", "arguments": {}}',
    "{",
    "}",
    "[",
    "]",
    "```",
    "```json\n",
    "\n",
    " ",
    "hello",
    "'",
    '"',
    "\\",
    "[TOOL_CALLS]",
    "get_weather[ARGS]",
    '{"location": "x"}',
    "<|python_tag|>",
    "<|tool_call>call:get_time{}<tool_call|>",
    "<function=get_time>",
    "</function>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁call▁begin｜>",
    "get_time<｜tool▁sep｜>{}",
    "<｜tool▁call▁end｜>",
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{}<|tool_call_end|>",
    "`",
    "<",
    ";",
    "```tool_code\nget_time()\n",
]


def test_fuzz_chunking_never_changes_the_result():
    from omlx.api.tool_call_formats import FAMILIES

    rng = random.Random(1234)
    for _ in range(300):
        text = "".join(rng.choice(FUZZ_ATOMS) for _ in range(rng.randint(1, 12)))
        kw = dict(
            family=rng.choice([*FAMILIES, None]),
            tools=rng.choice([TOOLS, None]),
            reasoning=rng.random() < 0.7,
            starts_in_reasoning=rng.random() < 0.2,
        )
        results = [summary(run(pieces, **kw)[0]) for pieces in chunkings(text)]
        assert all(r == results[0] for r in results), (text, kw)
        if kw["tools"] is None and not kw["reasoning"]:
            assert "".join(r[1] for r in results[0]) == text


def test_feed_after_finish_raises():
    parser = OutputParser(family=None, tools=None, reasoning=False)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


# --------------------------------------------------------------------------- arguments


def test_call_arguments_repairs_what_it_can_and_keeps_the_rest_as_generated():
    assert call_arguments(None) == ("{}", None)
    assert call_arguments("") == ("{}", None)
    assert json.loads(normalize_arguments({"a": 1})) == {"a": 1}
    assert json.loads(normalize_arguments('{"a": 1}')) == {"a": 1}
    assert json.loads(normalize_arguments('"{\\"a\\": 1}"')) == {"a": 1}  # encoded twice
    assert json.loads(normalize_arguments("{'a': 1}")) == {"a": 1}
    for value, text in [("not json", "not json"), ([1, 2], "[1, 2]"), ("[1, 2]", "[1, 2]"),
                        ('{"a": 1,,}', '{"a": 1,,}')]:
        got, problem = call_arguments(value)
        assert got == text and problem, (value, got, problem)
    assert call_arguments({"x": float("nan")})[1]


def test_arguments_that_are_no_object_stay_a_call_with_a_warning():
    check(
        '<tool_call>{"name": "search", "arguments": "find cats"}</tool_call>',
        [("call", "search", "find cats")],
        family="hermes",
    )
    out = parse_output('<tool_call>{"name": "search", "arguments": "find cats"}</tool_call>',
                       family="hermes", tools=TOOLS, reasoning=False)
    assert [w.code for w in out.warnings] == ["tool_arguments_invalid"]
    assert out.tool_calls[0].problem.startswith("arguments are not valid JSON")


# --------------------------------------------------------------------------- family detection


def _mlx_wrapper_for(template: str, vocab: dict | None = None):
    """What mlx-lm's TokenizerWrapper would expose for this template."""
    import importlib

    from mlx_lm.tokenizer_utils import _infer_tool_parser

    hf = SimpleNamespace(chat_template=template, get_vocab=lambda: vocab or {})
    name = _infer_tool_parser(hf)
    if name is None:
        return SimpleNamespace(chat_template=template, tool_parser=None, tool_call_start=None)
    module = importlib.import_module(f"mlx_lm.tool_parsers.{name}")
    return SimpleNamespace(
        chat_template=template,
        tool_parser=module.parse_tool_call,
        tool_call_start=module.tool_call_start,
    )


@pytest.mark.parametrize(
    "template,family",
    [
        (
            "{% for tool_call in message.tool_calls %}<tool_call>\n{{ tool_call.name }}</tool_call>{% endfor %}",
            "hermes",
        ),
        ("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}", "qwen3_coder"),
        (
            "<tool_call>{{ tc.name }}<arg_key>{{ k }}</arg_key><arg_value>{{ v }}</arg_value></tool_call>",
            "glm",
        ),
        ("{{ '<|tool_calls_section_begin|>' }}", "kimi_k2"),
        ("{{ '[TOOL_CALLS]' + tool_call.function.name + '[ARGS]' }}", "mistral"),
        ("{{ '<|tool_call>call:' + name }}{{ '<tool_call|>' }}", "gemma"),
        ("{{ '<start_function_call>' }}", "gemma"),
        (
            "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>'}}",
            "deepseek",
        ),
        (
            '{{- "Environment: ipython\\n" }}{{- \'Respond in the format {"name": function name, "parameters": '
            "dictionary of argument name and its value}.' }}",
            "llama3",
        ),
        ("{{ '<|tool_call_start|>' }}", "pythonic"),
        (
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
            None,
        ),
    ],
)
def test_detect_family(template, family):
    assert detect_family(_mlx_wrapper_for(template)) == family
    assert detect_family(SimpleNamespace(chat_template=template)) == family  # template text alone
    if family is not None:
        assert canonical_family(family) == family


def test_detect_family_without_template():
    assert detect_family(SimpleNamespace(chat_template=None)) is None
    assert detect_family(object()) is None


def test_canonical_family():
    assert canonical_family(None) is None
    assert canonical_family("json_tools") == "hermes"
    assert canonical_family("glm47") == "glm"
    assert canonical_family("gemma4") == "gemma"
    assert canonical_family("minimax_m2") == "minimax_m2"
    with pytest.raises(ValueError):
        canonical_family("no_such_family")
    with pytest.raises(ValueError):
        OutputParser(family="../evil", tools=TOOLS, reasoning=False)


# --------------------------------------------------------------------------- prompt injection

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QWEN_LIKE = "{%- if tools %}{{- '<|im_start|>system\\n# Tools' }}{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}{% endif %}"


def test_template_supports_tools():
    assert not template_supports_tools(SimpleNamespace(chat_template=CHATML))
    assert template_supports_tools(SimpleNamespace(chat_template=QWEN_LIKE))
    assert not template_supports_tools(SimpleNamespace(chat_template=None))
    assert template_supports_tools(
        SimpleNamespace(chat_template=None, _chat_template=lambda *a, **k: "")
    )


def test_inject_tools_into_system():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    out = inject_tools_into_system(messages, TOOLS)
    assert messages[0]["content"] == "Be brief."  # not mutated
    system = out[0]["content"]
    assert system.startswith("Be brief.\n\n")
    for name in ("get_weather", "get_time", "search"):
        assert name in system
    assert "Current weather for a city." in system and '"location"' in system
    assert "<tool_call>" in system and '"arguments"' in system
    assert out[1] == messages[1]

    out = inject_tools_into_system(
        [{"role": "user", "content": "hi"}], [{"name": "get_time", "input_schema": {}}]
    )
    assert out[0]["role"] == "system" and "get_time" in out[0]["content"]
    assert inject_tools_into_system(messages, None) == messages


def test_inject_rewrites_tool_history_and_renders_with_chatml():
    import jinja2

    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"location": "Paris"}'},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"location": "Rome"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
        {"role": "tool", "tool_call_id": "call_2", "content": "24C"},
    ]
    out = inject_tools_into_system(messages, TOOLS)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[2]["content"].count("<tool_call>") == 2 and "tool_calls" not in out[2]
    # the rewritten assistant turn is read back by the hermes parser as the same calls
    back = parse_output(out[2]["content"], family="hermes", tools=TOOLS, reasoning=False)
    assert [(c.name, json.loads(c.arguments)) for c in back.tool_calls] == [
        ("get_weather", {"location": "Paris"}),
        ("get_weather", {"location": "Rome"}),
    ]
    assert (
        out[3]["content"]
        == "<tool_response>\n18C\n</tool_response>\n<tool_response>\n24C\n</tool_response>"
    )
    rendered = (
        jinja2.Environment().from_string(CHATML).render(messages=out, add_generation_prompt=True)
    )
    assert "get_weather" in rendered and rendered.endswith("<|im_start|>assistant\n")


# --------------------------------------------------------------------------- with a real mlx-lm tokenizer

QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>"
    "<|im_end|>\n{%- endif %}{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    '{%- for tool_call in message.tool_calls or [] %}<tool_call>\n{"name": "{{ tool_call.name }}"}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize(
    "template,family,supports", [(None, None, False), (QWEN_STYLE, "hermes", True)]
)
def test_real_tokenizer_detection_and_token_streaming(tmp_path, template, family, supports):
    from mlx_lm.tokenizer_utils import load

    from tests.support.tiny_model import build_tokenizer

    build_tokenizer(tmp_path)
    if template is not None:
        config = json.loads((tmp_path / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load(tmp_path)
    assert detect_family(tok) == family
    assert template_supports_tools(tok) is supports

    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>'
    parser = OutputParser(family=family or "hermes", tools=TOOLS, reasoning=False)
    detok = tok.detokenizer
    deltas = []
    for token in tok.encode(text, add_special_tokens=False):
        detok.add_token(token)
        deltas += parser.feed(detok.last_segment)
    detok.finalize()
    deltas += parser.feed(detok.last_segment) + parser.finish()
    assert summary(deltas) == [("text", "Let me check."), call("get_weather", location="Paris")]
