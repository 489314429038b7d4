"""Grammars (llguidance Lark) for tool calls in each family's own syntax, arguments held to
each tool's JSON schema; one per entry of `tool_call_formats.FAMILIES`.

`calls_grammar` returns Lark rules defining `calls` and the family whose parser reads them: a
family without a grammar here (an mlx-lm parser module name) gets the hermes envelope, and its
output is read as hermes. The markup matches what `omlx.api.output_parser` accepts for the
family. `Marker` writes a marker as the special token(s) the tokenizer has for it, or as text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from omlx.engine.grammar import json_with_options

Marker = Callable[[str], str]  # marker text -> a Lark expression
MAX_CALLS = 4  # calls one answer may make when the tool is not named
EMPTY = '""'
FENCE = "\n```json\n"
DSML_OPEN = "<｜DSML｜function_calls>\n"
DSML_INVOKE_END = "</｜DSML｜invoke>\n"


def literal(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


class Rules:
    """Lark rules under construction, each a fresh name."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.count = 0

    def add(self, body: str, head: str | None = None) -> str:
        name = head or f"r{self.count}"
        self.count += 1
        self.lines.append(f"{name}: {body}")
        return name

    def json(self, schema: dict[str, Any]) -> str:
        return self.add("%json " + json.dumps(json_with_options(schema), ensure_ascii=False))

    def lazy(self, body: str, suffix: str) -> str:
        """A lazy terminal: it ends at the first `suffix` (a Lark string), which it consumes."""
        name = f"r{self.count}"
        self.count += 1
        self.lines.append(f"{name}[suffix={suffix}]: {body}")
        return name

    def __str__(self) -> str:
        return "\n".join(self.lines) + "\n"


def _properties(schema: dict[str, Any]) -> tuple[list[tuple[str, dict[str, Any]]], set[str]]:
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    return [(k, v if isinstance(v, dict) else {}) for k, v in props.items()], required


def _is_string(schema: dict[str, Any]) -> bool:
    return schema.get("type") == "string" or (
        "enum" in schema and all(isinstance(v, str) for v in schema["enum"]) and schema.get("type") in (None, "string")
    )


def raw_string(rules: Rules, schema: dict[str, Any], end: str) -> str:
    """A string value written unquoted up to `end` (a Lark expression, consumed here): its enum,
    its pattern, or any text within its length bounds."""
    if "enum" in schema or "const" in schema:
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        return rules.add(" | ".join(f"{literal(str(v))} {end}" for v in values))
    if "pattern" in schema:
        from omlx.engine.grammar import llguidance

        body = "/" + llguidance().regex_to_lark(schema["pattern"], "dw") + "/"
    else:
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        body = f"/(?s:.{{{low},{'' if high is None else high}}})/"
    if end.startswith("<["):  # a special token: text never produces one, so it ends the text
        return rules.add(f"{body} {end}")
    return rules.lazy(body, end)


def _sequence(items: list[tuple[str, bool]], sep: str) -> str:
    """Lark for `items` (expression, required) in order, joined by `sep`, optional ones free to
    be left out (each rule knows whether anything came before it)."""
    memo: dict[tuple[int, bool], str] = {}

    def tail(i: int, first: bool) -> str:
        if i == len(items):
            return '""'
        if (i, first) in memo:
            return memo[(i, first)]
        expr, required = items[i]
        here = f"{expr} {tail(i + 1, False)}" if first else f"{sep} {expr} {tail(i + 1, False)}"
        memo[(i, first)] = f"({here})" if required else f"({here} | {tail(i + 1, first)})"
        return memo[(i, first)]

    return tail(0, True)


# --------------------------------------------------------------------------- per family


def _hermes(rules: Rules, tools: list[dict], m: Marker, family_info: str) -> str:
    bodies = [
        rules.json({"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
                    "required": ["name", "arguments"], "additionalProperties": False})
        for t in tools
    ]
    return f'{m("<tool_call>")} "\\n" ({" | ".join(bodies)}) "\\n" {m("</tool_call>")}'


def _xml_params(rules: Rules, tool: dict, open_param: Callable[[str], str], close: str, after: str = "") -> str:
    """Parameters written one per tag (qwen3_coder, glm): strings raw, the rest JSON, each
    closed by the terminal `close` and then `after`."""
    props, required = _properties(tool["parameters"])
    items = []
    for key, schema in props:
        value = raw_string(rules, schema, close) if _is_string(schema) else f"{rules.json(schema)} {close}"
        items.append((f"{open_param(key)} {value} {after}".rstrip(), key in required))
    return _sequence(items, EMPTY)


def _qwen3_coder(rules: Rules, tools: list[dict], m: Marker, family_info: str) -> str:
    fns = []
    for t in tools:
        params = _xml_params(rules, t, lambda k: literal(f"<parameter={k}>\n"), literal("\n</parameter>\n"))
        head = literal("<function=" + t["name"] + ">\n")
        fns.append(rules.add(f'{head} {params} "</function>"'))
    return f'{m("<tool_call>")} "\\n" ({" | ".join(fns)}) "\\n" {m("</tool_call>")}'


def _glm(rules: Rules, tools: list[dict], m: Marker, family_info: str) -> str:
    fns = []
    for t in tools:
        params = _xml_params(
            rules, t, lambda k: f'{m("<arg_key>")} {literal(k)} {m("</arg_key>")} "\\n" {m("<arg_value>")}',
            m("</arg_value>"), '"\\n"',
        )
        fns.append(rules.add(f'{literal(t["name"])} "\\n" {params}'))
    return f'{m("<tool_call>")} ({" | ".join(fns)}) {m("</tool_call>")}'


def _llama3(rules: Rules, tools: list[dict], m: Marker, family_info: str) -> str:
    return " | ".join(
        rules.json({"type": "object", "properties": {"name": {"const": t["name"]}, "parameters": t["parameters"]},
                    "required": ["name", "parameters"], "additionalProperties": False})
        for t in tools
    )


def _mistral(rules: Rules, tools: list[dict], m: Marker, family_info: str) -> str:
    if "[ARGS]" in family_info:  # Devstral, Magistral, Small 3.2: name[ARGS]{...}
        fns = [f'{literal(t["name"])} {m("[ARGS]")} {rules.json(t["parameters"])}' for t in tools]
        return f'{m("[TOOL_CALLS]")} ({" | ".join(fns)})'
    items = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
                        "required": ["name", "arguments"], "additionalProperties": False} for t in tools]}
    return f'{m("[TOOL_CALLS]")} {rules.json({"type": "array", "items": items, "minItems": 1, "maxItems": 1})}'


def _gemma_value(rules: Rules, schema: dict[str, Any], quote: str, depth: int = 0) -> str:
    """A value in Gemma's call syntax: keys bare, strings between `quote` tokens, the rest JSON."""
    if depth < 8 and schema.get("anyOf"):
        return "(" + " | ".join(_gemma_value(rules, s, quote, depth + 1) for s in schema["anyOf"]) + ")"
    if _is_string(schema):
        return f"{quote} {raw_string(rules, schema, quote)}"
    if depth < 8 and schema.get("type") == "object" and schema.get("properties"):
        props, required = _properties(schema)
        items = [(f'{literal(k + ":")} {_gemma_value(rules, s, quote, depth + 1)}', k in required) for k, s in props]
        return rules.add(f'"{{" {_sequence(items, literal(","))} "}}"')
    if depth < 8 and schema.get("type") == "array" and isinstance(schema.get("items"), dict):
        item = _gemma_value(rules, schema["items"], quote, depth + 1)
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        more = f'("," {item}){{{max(low - 1, 0)},{"" if high is None else max(high - 1, 0)}}}'
        listed = f"{item} {more}"
        return rules.add(f'"[" {listed} "]"' if low else f'"[" ({listed})? "]"')
    return rules.json(schema)


def _gemma(rules: Rules, tools: list[dict], m: Marker, family_info: str) -> str:
    if "<start_function_call>" in family_info:  # FunctionGemma
        start, end, quote = m("<start_function_call>"), m("<end_function_call>"), m("<escape>")
    elif "<|tool_call>" in family_info:  # Gemma 4
        start, end, quote = m("<|tool_call>"), m("<tool_call|>"), m('<|"|>')
    else:  # Gemma 3 has no call tokens: a Python call in a tool_code fence
        fns = []
        for t in tools:
            props, required = _properties(t["parameters"])
            items = [(f"{literal(k + '=')} {rules.json(s)}", k in required) for k, s in props]
            fns.append(f'{literal(t["name"] + "(")} {_sequence(items, literal(", "))} ")"')
        return f'"```tool_code\\n" ({" | ".join(fns)}) "\\n```"'
    fns = [f'{literal("call:" + t["name"])} {_gemma_value(rules, t["parameters"], quote)}' for t in tools]
    return f'{start} ({" | ".join(fns)}) {end}'


def _deepseek(rules: Rules, tools: list[dict], m: Marker, family_info: str) -> str:
    begin, end = m("<｜tool▁calls▁begin｜>"), m("<｜tool▁calls▁end｜>")
    call_begin, sep, call_end = m("<｜tool▁call▁begin｜>"), m("<｜tool▁sep｜>"), m("<｜tool▁call▁end｜>")
    if "｜DSML｜" in family_info:  # V3.2 / V4
        fns = []
        for t in tools:
            props, required = _properties(t["parameters"])
            items = []
            for key, schema in props:
                head = f'<｜DSML｜parameter name="{key}" string="{"true" if _is_string(schema) else "false"}">'
                close = literal("</｜DSML｜parameter>\n")
                value = raw_string(rules, schema, close) if _is_string(schema) else f"{rules.json(schema)} {close}"
                items.append((f"{literal(head)} {value}", key in required))
            invoke = literal(f'<｜DSML｜invoke name="{t["name"]}">\n')
            fns.append(f"{invoke} {_sequence(items, EMPTY)} {literal(DSML_INVOKE_END)}")
        return f'{literal(DSML_OPEN)} ({" | ".join(fns)}) {literal("</｜DSML｜function_calls>")}'
    if "```json" in family_info:  # V3 / R1: type, separator, name, arguments in a json fence
        fns = [f'"function" {sep} {literal(t["name"] + FENCE)} {rules.json(t["parameters"])} "\\n```"' for t in tools]
    else:  # V3.1: name, separator, arguments
        fns = [f'{literal(t["name"])} {sep} {rules.json(t["parameters"])}' for t in tools]
    return f'{begin} {call_begin} ({" | ".join(fns)}) {call_end} {end}'


def _kimi_k2(rules: Rules, tools: list[dict], m: Marker, family_info: str) -> str:
    fns = [f'{literal("functions." + t["name"] + ":0")} {m("<|tool_call_argument_begin|>")} {rules.json(t["parameters"])}'
           for t in tools]
    return (f'{m("<|tool_calls_section_begin|>")} {m("<|tool_call_begin|>")} ({" | ".join(fns)}) '
            f'{m("<|tool_call_end|>")} {m("<|tool_calls_section_end|>")}')


GRAMMARS: dict[str, Callable[[Rules, list[dict], Marker, str], str]] = {
    "hermes": _hermes,
    "qwen3_coder": _qwen3_coder,
    "glm": _glm,
    "llama3": _llama3,
    "mistral": _mistral,
    "gemma": _gemma,
    "deepseek": _deepseek,
    "kimi_k2": _kimi_k2,
}


def opener(family: str, family_info: str = "") -> str:
    """The text a call of `family` (as `calls_grammar` writes it) begins with."""
    if family == "gemma":
        for start in ("<start_function_call>", "<|tool_call>"):
            if start in family_info:
                return start
        return "```tool_code"
    if family == "deepseek" and "｜DSML｜" in family_info:
        return "<｜DSML｜function_calls>"
    return {"llama3": "{", "mistral": "[TOOL_CALLS]", "deepseek": "<｜tool▁calls▁begin｜>",
            "kimi_k2": "<|tool_calls_section_begin|>"}.get(family, "<tool_call>")  # fmt: skip


def calls_grammar(
    family: str | None, tools: list[dict], marker: Marker, *, single: bool, family_info: str = ""
) -> tuple[str, str]:
    """(Lark rules defining `calls`: one call, or up to `MAX_CALLS` unless `single`, to one of
    `tools` — {"name", "parameters"} — in `family`'s syntax; the family whose parser reads it).
    `family_info`: the model's chat template and marker vocabulary, for families with variants."""
    name = family if family in GRAMMARS else "hermes"
    rules = Rules()
    call = rules.add(GRAMMARS[name](rules, tools, marker, family_info), head="call")
    rules.add(call if single or name in ("llama3", "mistral") else f'{call} ("\\n" {call}){{0,{MAX_CALLS - 1}}}',
              head="calls")
    return str(rules), name
