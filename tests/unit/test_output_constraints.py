"""Structured output without a model: the constraint's state machine, the tool-call grammars of
every family against the output parser, schema closing, and the refusals of what cannot be
enforced. Grammars compile against a real llguidance tokenizer (the tiny test tokenizer)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import numpy as np
import pytest

from omlx.api.output_parser import OutputParser
from omlx.api.tool_call_formats import FAMILIES
from omlx.api.tool_call_grammars import calls_grammar
from omlx.api.tool_calls import ToolCall
from omlx.engine.constraints import Constraint, ConstraintState, Phase, Reasoning, Rule
from omlx.engine.grammar import (
    closed_objects,
    compile_grammar,
    ll_tokenizer,
    llguidance,
    token_marker,
)
from omlx.errors import InvalidRequestError
from omlx.server.structured import tool_forcing
from tests.support.tiny_model import build_tokenizer

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"],
    },
}
FILES = {"name": "list_files", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}
ARGS = {"city": "Paris", "days": 2}

# one output per family (and variant), as the model would print the call get_weather(ARGS)
SAMPLES = [
    ("hermes", "", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'),
    ("qwen3_coder", "", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"),
    ("glm", "", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"),
    ("llama3", "", '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'),
    ("mistral", "", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]'),
    ("mistral", "[ARGS]", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'),
    ("gemma", "<|tool_call>", '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:2}<tool_call|>'),
    ("gemma", "<start_function_call>", "<start_function_call>call:get_weather{city:<escape>Paris<escape>,days:2}<end_function_call>"),
    ("gemma", "", '```tool_code\nget_weather(city="Paris", days=2)\n```'),
    ("deepseek", "", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                     '{"city": "Paris", "days": 2}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("deepseek", "```json", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                            '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("deepseek", "｜DSML｜", '<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
                            '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
                            '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
                            "</｜DSML｜invoke>\n</｜DSML｜function_calls>"),
    ("kimi_k2", "", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                    '{"city": "Paris", "days": 2}<|tool_call_end|><|tool_calls_section_end|>'),
]  # fmt: skip


@pytest.fixture(scope="module")
def lltok(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    hf = AutoTokenizer.from_pretrained(str(out))
    return ll_tokenizer(hf, len(hf), [hf.convert_tokens_to_ids("<|im_end|>")], "tiny")


def accepts(lltok, grammar: str, text: str) -> bool:
    matcher = compile_grammar(lltok, grammar, "test")
    return matcher.consume_tokens(lltok.tokenize_str(text)) and matcher.is_accepting()


@pytest.mark.parametrize(("family", "info", "text"), SAMPLES, ids=[f"{f}-{i or 'plain'}" for f, i, _ in SAMPLES])
def test_each_familys_grammar_accepts_its_call_and_the_parser_reads_it_back(lltok, family, info, text) -> None:
    rules, reader = calls_grammar(family, [WEATHER, FILES], token_marker(lltok), single=True, family_info=info)
    grammar = llguidance().LLMatcher.grammar_from_lark("start: calls\n" + rules)
    assert accepts(lltok, grammar, text)
    assert not accepts(lltok, grammar, text.replace("2", "9", 1))  # days ≤ 7
    tools = [{"type": "function", "function": t} for t in (WEATHER, FILES)]
    parser = OutputParser(family=reader, tools=tools, reasoning=False)
    calls = [d for d in parser.feed(text) + parser.finish() if isinstance(d, ToolCall)]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGS)]


def test_every_family_has_a_grammar_and_others_get_the_hermes_envelope(lltok) -> None:
    assert {f for f, _, _ in SAMPLES} == set(FAMILIES)
    assert calls_grammar("pythonic", [WEATHER], token_marker(lltok), single=True)[1] == "hermes"


def test_the_tool_choice_decides_what_is_forced() -> None:
    strict = {**WEATHER, "strict": True}
    assert tool_forcing([WEATHER, FILES], "auto", has_format=False) is None  # auto stays free
    assert tool_forcing([WEATHER, FILES], "none", has_format=True) is None
    required = tool_forcing([WEATHER, FILES], "required", has_format=False)
    assert required.single and not required.free_text and [t["name"] for t in required.tools] == ["get_weather", "list_files"]
    named = tool_forcing([WEATHER, FILES], "list_files", has_format=False)
    assert [t["name"] for t in named.tools] == ["list_files"] and named.single
    held = tool_forcing([strict, FILES], None, has_format=False)
    assert held.free_text and held.tools[0]["parameters"] == WEATHER["parameters"]
    assert held.tools[1]["parameters"] == {"type": "object"}  # not strict: any arguments


def test_under_auto_a_strict_tool_or_a_format_leaves_a_free_answer_but_holds_calls(lltok, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from omlx.api.output_format import OutputFormat
    from omlx.server.structured import _compile

    build_tokenizer(tmp_path)
    engine = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(str(tmp_path)), model_id="tiny")
    engine.model_vocab_size, engine.eos_ids = len(engine.tokenizer), [engine.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": %d}}\n</tool_call>'

    def accepts(matcher, text: str) -> bool:
        matcher = matcher.deep_copy()
        return matcher.consume_tokens(lltok.tokenize_str(text)) and matcher.is_accepting()

    strict, _ = _compile(engine, None, tool_forcing([{**WEATHER, "strict": True}, FILES], "auto", False), "hermes")
    assert accepts(strict, "It is sunny in Paris.") and accepts(strict, call % 2)
    assert not accepts(strict, call % 9)
    fmt = OutputFormat("json", {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}, "x")
    held, _ = _compile(engine, fmt, tool_forcing([WEATHER], "auto", True), "hermes")
    assert accepts(held, '{"ok": true}') and accepts(held, call % 9)  # a tool not strict: any arguments
    assert not accepts(held, "It is sunny.") and not accepts(held, '{"ok": 1}')


def test_closed_objects_only_narrow_what_the_schema_allows() -> None:
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {}}}},
              "$defs": {"p": {"type": "object", "properties": {"q": {}}}}}  # fmt: skip
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert closed["$defs"]["p"]["additionalProperties"] is False
    jsonschema.validate({"properties": {"a": 1}}, closed)
    for combining in ({"allOf": [schema]}, {"not": schema}, {"$ref": "#/$defs/p", "properties": {"x": {}}}):
        assert closed_objects(combining) == combining  # intersections and negations are left as they are
    assert closed_objects({"type": "object", "properties": {}, "additionalProperties": True})["additionalProperties"] is True


def state(reasoning: Reasoning | None, grammar: bool = False) -> ConstraintState:
    class Matcher:  # only asked whether it exists; the grammar phase is tested through the server
        pass

    return ConstraintState(Constraint(64, (2,), None, reasoning), Matcher() if grammar else None)


def test_a_thinking_budget_forces_what_is_left_of_the_end_marker() -> None:
    s = state(Reasoning(end=(7, 8), budget=3))
    for token in (10, 11, 7):  # the third token happens to begin the marker
        assert s.allowed() is None
        s.advance(token)
    assert s.phase is Phase.FORCING and s.allowed() == Rule(Rule.ONLY, (8,))
    s.advance(8)
    assert s.phase is Phase.FREE and not s.needs_tokens
    assert state(Reasoning(end=(7, 8), budget=0)).allowed() == Rule(Rule.ONLY, (7,))


def test_reasoning_that_ends_on_its_own_is_not_forced_and_a_grammar_waits_for_it() -> None:
    s = state(Reasoning(end=(7,), budget=5), grammar=True)
    assert s.allowed() == Rule(Rule.BUT, (2,))  # under a grammar the output may not end while reasoning
    s.advance(7)
    assert s.phase is Phase.ANSWER and s.allowed() == Rule(Rule.GRAMMAR)
    opening = state(Reasoning(end=(7,), open=False, start=6), grammar=True)
    assert opening.allowed() == Rule(Rule.GRAMMAR, (6,))  # the answer, or the opening of reasoning
    opening.advance(6)
    assert opening.phase is Phase.REASONING


def test_a_budget_of_zero_never_lets_reasoning_open() -> None:
    # thinking off (the chat's `thinking_budget: 0`): before, a model that opened reasoning anyway
    # (or again, after its forced end) reasoned on, and the chat showed a thinking block
    free = state(Reasoning(end=(7,), open=False, start=6, budget=0))
    assert free.allowed() == Rule(Rule.BUT, (6,))
    free.advance(10)
    assert free.phase is Phase.FREE and free.allowed() == Rule(Rule.BUT, (6,))  # nor later in the answer
    held = state(Reasoning(end=(7,), open=False, start=6, budget=0), grammar=True)
    assert held.allowed() == Rule(Rule.GRAMMAR)  # the grammar's tokens alone
    assert state(Reasoning(end=(7,), open=False, start=6, budget=1)).allowed() is None
    # a prompt that opened reasoning: the end forced at once, and no second block after it
    opened = state(Reasoning(end=(7,), open=True, start=6, budget=0))
    assert opened.allowed() == Rule(Rule.ONLY, (7,))
    opened.advance(7)
    assert opened.phase is Phase.FREE and opened.allowed() == Rule(Rule.BUT, (6,))
    spent = state(Reasoning(end=(7,), open=True, start=6, budget=1))  # a budget above 0 limits one block only
    spent.advance(10)
    spent.advance(7)
    assert spent.phase is Phase.FREE and spent.allowed() is None


def test_a_complete_grammar_allows_every_eos_id_and_nothing_else(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from omlx.engine.constraints import fill_words
    from omlx.engine.token_mask import mask_words

    build_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    eos = sorted(hf.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    lltok = ll_tokenizer(hf, len(hf), eos, "tiny-two-eos")
    matcher = compile_grammar(lltok, llguidance().LLMatcher.grammar_from_regex("ab"), "regex")
    assert matcher.consume_tokens(lltok.tokenize_str("ab"))
    words = np.zeros((1, mask_words(len(hf))), dtype=np.int32)
    fill_words(words, Rule(Rule.GRAMMAR), matcher)
    allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
    assert allowed.tolist() == eos


def test_without_llguidance_a_constrained_request_is_a_400_naming_it(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "llguidance", None)  # as on a platform without its wheel
    with pytest.raises(InvalidRequestError, match="'llguidance' package") as caught:
        llguidance()
    assert caught.value.status == 400


def test_a_tokenizer_that_cannot_be_mapped_is_a_400(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="tokenizer cannot be mapped") as caught:
        ll_tokenizer(object(), 64, [2], "odd-model")
    assert caught.value.param == "model"
