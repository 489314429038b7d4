"""Turn generated text into typed deltas: visible text, reasoning and tool calls.

Every API (OpenAI chat, Anthropic Messages, Responses) feeds the detokenized
model output through an :class:`OutputParser` as it arrives, in chunks of any
size, and gets back a list of deltas per chunk:

* :class:`TextDelta` - answer text, never containing tool-call markup;
* :class:`ReasoningDelta` - the text of a ``<think>…</think>`` block;
* :class:`ToolCall` - one complete call, ``arguments`` always a JSON object text.

This module has no HTTP or engine dependencies. The text inside a family's
tool-call markers is parsed with mlx-lm's own parsers (``mlx_lm.tool_parsers``)
where mlx-lm has one; small parsers here cover the rest (Llama 3 JSON,
DeepSeek, the bare-JSON and fenced fallbacks of small models).

Families (``family=``, see :func:`detect_family`), as the models print them:

``hermes`` (Qwen2.5/Qwen3, Hermes, the prompt of :mod:`omlx.api.tool_prompt`)
    ``<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>``, one block per call.
``qwen3_coder``
    ``<tool_call>\\n<function=f>\\n<parameter=x>\\n1\\n</parameter>\\n</function>\\n</tool_call>``
    (a ``<function=…>`` block without the ``<tool_call>`` wrapper is accepted too).
``glm`` (GLM 4.5/4.6/4.7)
    ``<tool_call>f\\n<arg_key>x</arg_key>\\n<arg_value>1</arg_value>\\n</tool_call>``
    (4.7 drops the newlines).
``llama3`` (Llama 3.1/3.2/3.3)
    ``{"name": "f", "parameters": {"x": 1}}`` as the whole answer, possibly after
    ``<|python_tag|>``; several calls separated by ``;``; built-in tools as
    ``<|python_tag|>brave_search.call(query="…")``.
``mistral``
    ``[TOOL_CALLS][{"name": "f", "arguments": {…}, "id": "abc123def"}]`` (7B v0.3, Nemo),
    ``[TOOL_CALLS]f[ARGS]{…}`` (Devstral, Magistral), ``[TOOL_CALLS]f[CALL_ID]abc123def[ARGS]{…}``
    (Small 3.2). There is no end marker: the calls run to the end of the output.
``gemma``
    Gemma 4 ``<|tool_call>call:f{x:<|"|>text<|"|>,n:1}<tool_call|>``; FunctionGemma
    ``<start_function_call>call:f{x:<escape>text<escape>}<end_function_call>``; Gemma 3
    (no native tokens) prints Python calls in a ```` ```tool_code```` fence.
``deepseek``
    V3/R1 ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\\n```json\\n{…}\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>``;
    V3.1 ``…<｜tool▁call▁begin｜>f<｜tool▁sep｜>{…}<｜tool▁call▁end｜>…``; V3.2/V4 DSML
    ``<｜DSML｜function_calls>`` (or ``tool_calls``) ``<｜DSML｜invoke name="f"><｜DSML｜parameter name="x" string="true">…</｜DSML｜parameter></｜DSML｜invoke>…``.
``kimi_k2``
    ``<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{…}<|tool_call_end|><|tool_calls_section_end|>``.
Any other mlx-lm parser module name (``pythonic``, ``minimax_m2``, ``longcat``, ``minicpm5``,
``muse_spark``, ``kimi_k3`` …) is accepted as a family and uses that module's markers and parser.
``None`` (unknown template) accepts the hermes markup.

Rules:

* Tool calls are only recognised when tools were offered (``tools`` non-empty); without
  tools the output is text (and reasoning).
* Native markup is accepted for any tool name; the fallbacks of small models - a bare JSON
  object ``{"name": …, "arguments"|"parameters": {…}}`` (or a list of them) at the start of
  the answer (after reasoning, or right after another call) and the same in a
  ```` ```json```` (or bare ```` ``` ````, ```` ```tool_call````) fence, Python calls in a
  ```` ```tool_code```` fence - only count when every name is an offered tool; otherwise they
  are text.
* Text that could still become markup is held back until decided (a partial marker at the end
  of a chunk, an answer starting with ``{``/``[`` until that JSON value closes, a JSON-ish
  fence until it closes). Whitespace right before a call is dropped, as is whitespace at the
  start of the answer after reasoning or after a call, and around the reasoning text.
* ``arguments`` is always the text of a JSON object: ``"{}"`` when a call has none, arguments
  given as a JSON string are decoded and re-serialized, and anything that is not a JSON object
  (unparseable text, a list, a number) is kept as ``{"_raw": "<the text>"}``.
* Markup that cannot be parsed (e.g. generation cut off inside a call) is given back as text,
  verbatim, once it is known to be unparseable.
* Inside reasoning, tool-call markup is not interpreted.
* Every call gets a fresh id ``call_<24 hex>``; an id the model printed itself (Kimi's
  ``functions.f:0``, Mistral's 9-character ids) is kept in ``ToolCall.model_id``.
* Llama 3's JSON without ``<|python_tag|>`` is read by the bare-JSON fallback, so its names
  must be offered tools. A stray ``</think>`` outside reasoning is dropped.

Typical use, with an mlx-lm ``TokenizerWrapper`` ``tok``::

    parser = OutputParser(
        family=detect_family(tok),              # or "hermes" after tool_prompt injection
        tools=request_tools,
        reasoning=tok.has_thinking,
        think_start=tok.think_start or "<think>",
        think_end=tok.think_end or "</think>",
        starts_in_reasoning=prompt_opens_reasoning(prompt_text, tok.think_start, tok.think_end),
    )
    for segment in generated_segments:
        send(parser.feed(segment))
    send(parser.finish())
"""

from __future__ import annotations

import ast
import functools
import importlib
import json
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

__all__ = [
    "TextDelta",
    "ReasoningDelta",
    "ToolCall",
    "Delta",
    "OutputParser",
    "ParsedOutput",
    "parse_output",
    "detect_family",
    "canonical_family",
    "normalize_arguments",
    "normalize_tools",
    "tool_names",
    "new_call_id",
    "prompt_opens_reasoning",
    "FAMILIES",
]


# --------------------------------------------------------------------------- deltas


@dataclass
class TextDelta:
    text: str


@dataclass
class ReasoningDelta:
    text: str


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # text of a JSON object, "{}" when there are none
    model_id: str | None = field(default=None, compare=False)  # the id the model printed, if any


Delta = TextDelta | ReasoningDelta | ToolCall


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# --------------------------------------------------------------------------- tools and arguments


def normalize_tools(tools: Iterable[dict] | None) -> list[dict]:
    """Tools in the OpenAI chat shape ``{"type": "function", "function": {name, description, parameters}}``.

    Accepts that shape, the flat Responses shape ``{"type": "function", "name": …, "parameters": …}``
    and the Anthropic shape ``{"name": …, "input_schema": …}``. Entries without a name are skipped.
    """
    out = []
    for tool in tools or []:
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            continue
        params = fn.get("parameters")
        if params is None:
            params = fn.get("input_schema")
        spec: dict[str, Any] = {"name": name}
        if fn.get("description"):
            spec["description"] = fn["description"]
        spec["parameters"] = (
            params if isinstance(params, dict) else {"type": "object", "properties": {}}
        )
        out.append({"type": "function", "function": spec})
    return out


def tool_names(tools: Iterable[dict] | None) -> set[str]:
    return {t["function"]["name"] for t in normalize_tools(tools)}


def _raw(text: str) -> str:
    return json.dumps({"_raw": text}, ensure_ascii=False)


def _dump_object(value: dict) -> str:
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, default=str)
    except (TypeError, ValueError):  # NaN/inf, non-string keys
        return _raw(str(value))


def normalize_arguments(value: Any) -> str:
    """The text of a JSON object for a call's arguments (see the module notes)."""
    if value is None:
        return "{}"
    if isinstance(value, dict):
        return _dump_object(value)
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return "{}"
        decoded: Any = text
        for _ in range(2):  # arguments sometimes arrive JSON-encoded twice
            try:
                decoded = json.loads(decoded)
            except (ValueError, RecursionError):
                decoded = _python_literal(decoded)
                if decoded is None:
                    return _raw(value)
            if not isinstance(decoded, str):
                break
        if decoded is None:
            return "{}"
        if isinstance(decoded, dict):
            return _dump_object(decoded)
        return _raw(value)
    try:
        return _raw(json.dumps(value, ensure_ascii=False, default=str))
    except (TypeError, ValueError):
        return _raw(str(value))


def _python_literal(text: str) -> Any:
    """A Python dict/list literal (small models print ``{'x': 1}``), else None."""
    if not isinstance(text, str) or text.lstrip()[:1] not in ("{", "["):
        return None
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return None


def _looks_like_schema(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and value.get("type") == "object"
        and isinstance(value.get("properties"), dict)
    )


def _call_from_dict(d: Any) -> dict | None:
    """``{"name", "arguments"|"parameters", "id"?}`` or ``{"function": {"name", "arguments"}}``."""
    if not isinstance(d, dict):
        return None
    fn = d.get("function")
    if isinstance(fn, dict) and isinstance(fn.get("name"), str) and "arguments" in fn:
        name, args = fn["name"], fn.get("arguments")
    else:
        name = d.get("name")
        if not isinstance(name, str) and isinstance(fn, str):
            name = fn  # {"function": "f", "arguments": {...}}
        if not isinstance(name, str):
            return None
        if "arguments" in d:
            args = d["arguments"]
        elif "parameters" in d:
            args = d["parameters"]
            if "description" in d and _looks_like_schema(args):
                return None  # the model repeated a tool definition
        else:
            args = None
    if not name.strip():
        return None
    call = {"name": name.strip(), "arguments": args}
    if isinstance(d.get("id"), str):
        call["id"] = d["id"]
    return call


def _calls_from_json(value: Any, known: set[str] | None) -> list[dict] | None:
    """Calls from a decoded JSON value (an object or a list of objects); None if it is not one."""
    items = value if isinstance(value, list) else [value]
    if not items:
        return None
    calls = []
    for item in items:
        call = _call_from_dict(item)
        if call is None or (known is not None and call["name"] not in known):
            return None
        calls.append(call)
    return calls


def _json_values(text: str) -> list[Any]:
    """Decode one JSON value, or several separated by whitespace, ``;`` or ``,``."""
    text = text.strip()
    try:
        return [json.loads(text)]
    except ValueError:
        pass
    decoder = json.JSONDecoder()
    values, pos = [], 0
    try:
        while pos < len(text):
            if values and not text[pos:].strip("}] \t\r\n"):
                break  # a stray closing brace after the last value, a common small-model slip
            value, pos = decoder.raw_decode(text, pos)
            values.append(value)
            while pos < len(text) and (text[pos].isspace() or text[pos] in ";,"):
                pos += 1
    except ValueError:
        literal = _python_literal(text)
        if literal is None:
            raise
        return [literal]
    return values


# --------------------------------------------------------------------------- per-family parsers
#
# Each takes the text between a start and an end marker (and the offered tools, OpenAI shape)
# and returns a list of {"name", "arguments", "id"?} dicts, raising on failure.


@functools.cache
def _mlx_parser(module: str):
    return importlib.import_module(f"mlx_lm.tool_parsers.{module}")


def _as_list(parsed: Any) -> list:
    return parsed if isinstance(parsed, list) else [parsed]


def _parse_with_mlx(module: str) -> Callable[[str, list | None], list[dict]]:
    def parse(inner: str, tools: list | None) -> list[dict]:
        return _as_list(_mlx_parser(module).parse_tool_call(inner, tools))

    return parse


_FUNCTION_BLOCK = re.compile(r"<function=.*?(?:</function>|$)", re.DOTALL)


def _parse_qwen3_coder_functions(text: str, tools: list | None) -> list[dict]:
    parser = _mlx_parser("qwen3_coder")
    calls = []
    for block in _FUNCTION_BLOCK.findall(text):
        block = block.strip()
        if not block.endswith("</function>"):
            block += "</function>"  # the model closed the call but not the function
        calls.append(parser.parse_tool_call(block, tools))
    if not calls:
        raise ValueError("no <function=...> block")
    return calls


def _parse_tag_piece(text: str, tools: list | None, glm: bool) -> list[dict]:
    if "<function=" in text:
        return _parse_qwen3_coder_functions(text, tools)
    if "<arg_key>" in text:
        return [_mlx_parser("glm47").parse_tool_call(text, tools)]
    try:
        try:
            value = _mlx_parser("json_tools").parse_tool_call(text, tools)
            values = [value]
        except ValueError:
            values = _json_values(text)
        calls = []
        for value in values:
            got = _calls_from_json(value, None)
            if got is None:
                raise ValueError("not a tool call object")
            calls.extend(got)
        return calls
    except ValueError:
        if glm:  # "f" alone (no arguments), "f\n{json}", "f a=1"
            return [_mlx_parser("glm47").parse_tool_call(text, tools)]
        raise


def _tag_parser(glm: bool) -> Callable[[str, list | None], list[dict]]:
    def parse(inner: str, tools: list | None) -> list[dict]:
        # A call whose close tag was left out runs into the next "<tool_call>".
        pieces = [p.strip() for p in inner.split("<tool_call>") if p.strip()]
        if not pieces:
            raise ValueError("empty tool call")
        calls = []
        for piece in pieces:
            calls.extend(_parse_tag_piece(piece, tools, glm))
        return calls

    return parse


def _parse_bare_function(inner: str, tools: list | None) -> list[dict]:
    return _parse_qwen3_coder_functions("<function=" + inner + "</function>", tools)


_CALL_ID = re.compile(r"\[CALL_ID\]\s*([A-Za-z0-9_-]+)\s*(?=\[ARGS\])")


def _parse_mistral(inner: str, tools: list | None) -> list[dict]:
    parser = _mlx_parser("mistral")
    calls = []
    for piece in inner.split("[TOOL_CALLS]"):  # one marker per call in the [ARGS] format
        piece = piece.strip()
        if not piece:
            continue
        ids = _CALL_ID.findall(piece)
        parsed = _as_list(parser.parse_tool_call(_CALL_ID.sub("", piece), tools))
        if ids and len(ids) == len(parsed):
            for call, call_id in zip(parsed, ids, strict=True):
                call.setdefault("id", call_id)
        calls.extend(parsed)
    if not calls:
        raise ValueError("no tool call after [TOOL_CALLS]")
    return calls


_PRINT_CALL = re.compile(r"print\((.*)\)\s*$", re.DOTALL)


def _pythonic_calls(code: str, tools: list | None) -> list[dict]:
    """Python call syntax (``f(x=1)``, one per line or a list) via mlx-lm's pythonic parser."""
    code = code.strip()
    printed = _PRINT_CALL.match(code)  # Gemma 3 examples wrap the call in print(...)
    if printed:
        code = printed.group(1).strip()
    if not code:
        raise ValueError("empty")
    parser = _mlx_parser("pythonic")
    candidates = [code] if code.startswith("[") else ["[" + code + "]"]
    lines = [line.strip().rstrip(",;") for line in code.splitlines() if line.strip()]
    if len(lines) > 1:
        candidates.append("[" + ", ".join(lines) + "]")
    last_error: Exception = ValueError("no call")
    for candidate in candidates:
        try:
            return _as_list(parser.parse_tool_call(candidate, tools))
        except (ValueError, SyntaxError) as exc:
            last_error = exc
    raise last_error


_BUILTIN_CALL = re.compile(r"([\w.]+?)\.call\((.*)\)\s*$", re.DOTALL)


def _parse_llama3(inner: str, tools: list | None) -> list[dict]:
    text = inner.replace("<|eom_id|>", "").replace("<|eot_id|>", "").strip()
    if text[:1] in ("{", "["):
        calls = []
        for value in _json_values(text):
            got = _calls_from_json(value, None)
            if got is None:
                raise ValueError("not a tool call object")
            calls.extend(got)
        return calls
    match = _BUILTIN_CALL.match(text)  # built-in tool: brave_search.call(query="...")
    if match:
        return _pythonic_calls(f"{match.group(1)}({match.group(2)})", tools)
    return _pythonic_calls(text, tools)


_DS_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)(?:<｜tool▁call▁end｜>|$)", re.DOTALL)
_DS_FENCE = re.compile(r"```[\w-]*\s*(.*?)\s*(?:```|$)", re.DOTALL)


def _parse_deepseek_call(body: str) -> dict:
    head, sep, rest = body.partition("<｜tool▁sep｜>")
    if not sep:
        raise ValueError("no <｜tool▁sep｜>")
    head = head.strip()
    if head == "function":  # V3/R1: type, separator, name, then the arguments in a json fence
        name, _, args = rest.partition("\n")
        fence = _DS_FENCE.search(args)
        args = fence.group(1) if fence else args
    else:  # V3.1: name, separator, arguments
        name, args = head, rest
    if not name.strip():
        raise ValueError("no function name")
    return {"name": name.strip(), "arguments": args.strip()}


def _parse_deepseek(inner: str, tools: list | None) -> list[dict]:
    bodies = [b for b in _DS_CALL.findall(inner) if b.strip()] or [inner]
    return [_parse_deepseek_call(body) for body in bodies]


_DSML_INVOKE = re.compile(
    r'<｜DSML｜invoke\s+name="([^"]*)"\s*>(.*?)(?:</｜DSML｜invoke>|$)', re.DOTALL
)
_DSML_PARAM = re.compile(
    r'<｜DSML｜parameter\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*>(.*?)</｜DSML｜parameter>',
    re.DOTALL,
)


def _param_types(name: str, tools: list | None) -> dict[str, Any]:
    for tool in tools or []:
        fn = tool.get("function") or {}
        if fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k: (v or {}).get("type") for k, v in props.items() if isinstance(v, dict)}
    return {}


def _parse_dsml(inner: str, tools: list | None) -> list[dict]:
    calls = []
    for name, body in _DSML_INVOKE.findall(inner):
        types = _param_types(name, tools)
        args: dict[str, Any] = {}
        for key, string, value in _DSML_PARAM.findall(body):
            if string == "true" or (not string and types.get(key) == "string"):
                args[key] = value
                continue
            try:
                args[key] = json.loads(value)
            except ValueError:
                args[key] = value
        calls.append({"name": name.strip(), "arguments": args})
    if not calls:
        raise ValueError("no DSML invoke")
    return calls


# --------------------------------------------------------------------------- families


@dataclass(frozen=True)
class _Markup:
    start: str
    end: str  # "" = the calls run to the end of the output
    parse: Callable[[str, list | None], list[dict]]


_HERMES = [_Markup("<tool_call>", "</tool_call>", _tag_parser(glm=False))]

_FAMILY_MARKUP: dict[str, list[_Markup]] = {
    "hermes": _HERMES,
    "qwen3_coder": [
        _Markup("<tool_call>", "</tool_call>", _tag_parser(glm=False)),
        _Markup("<function=", "</function>", _parse_bare_function),
    ],
    "glm": [_Markup("<tool_call>", "</tool_call>", _tag_parser(glm=True))],
    "llama3": [_Markup("<|python_tag|>", "", _parse_llama3)],
    "mistral": [_Markup("[TOOL_CALLS]", "", _parse_mistral)],
    "gemma": [
        _Markup("<|tool_call>", "<tool_call|>", _parse_with_mlx("gemma4")),
        _Markup("<start_function_call>", "<end_function_call>", _parse_with_mlx("function_gemma")),
    ],
    "deepseek": [
        _Markup("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", _parse_deepseek),
        _Markup("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", _parse_deepseek),
        _Markup("<｜DSML｜function_calls>", "</｜DSML｜function_calls>", _parse_dsml),
        _Markup("<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", _parse_dsml),
    ],
    "kimi_k2": [
        _Markup(
            "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", _parse_with_mlx("kimi_k2")
        ),
        _Markup("<|tool_call_begin|>", "<|tool_call_end|>", _parse_with_mlx("kimi_k2")),
    ],
}

FAMILIES = tuple(_FAMILY_MARKUP)

_ALIASES = {
    "json_tools": "hermes",
    "qwen": "hermes",
    "qwen2": "hermes",
    "qwen2_5": "hermes",
    "qwen3": "hermes",
    "glm47": "glm",
    "glm45": "glm",
    "glm4": "glm",
    "glm4_moe": "glm",
    "laguna": "glm",
    "gemma4": "gemma",
    "function_gemma": "gemma",
    "gemma3": "gemma",
    "llama": "llama3",
    "llama3_json": "llama3",
    "deepseek_v3": "deepseek",
    "deepseek_r1": "deepseek",
    "deepseek_v31": "deepseek",
    "deepseek_v32": "deepseek",
    "kimi": "kimi_k2",
}


def canonical_family(family: str | None) -> str | None:
    """Our family name for ``family`` (aliases and mlx-lm parser module names accepted)."""
    if not family:
        return None
    name = family.strip().lower().replace("-", "_").replace(".", "")
    name = _ALIASES.get(name, name)
    if name in _FAMILY_MARKUP:
        return name
    if re.fullmatch(r"[a-z0-9_]+", name):
        try:
            module = _mlx_parser(name)
        except ImportError:
            module = None
        if (
            module is not None
            and hasattr(module, "parse_tool_call")
            and getattr(module, "tool_call_start", None)
        ):
            return name
    raise ValueError(f"unknown tool-call family {family!r}")


def _markups_for(family: str | None) -> list[_Markup]:
    if family is None:
        return _HERMES
    if family in _FAMILY_MARKUP:
        return _FAMILY_MARKUP[family]
    module = _mlx_parser(family)
    return [_Markup(module.tool_call_start, module.tool_call_end or "", _parse_with_mlx(family))]


_MODULE_FAMILY = {
    "json_tools": "hermes",
    "glm47": "glm",
    "laguna": "glm",
    "gemma4": "gemma",
    "function_gemma": "gemma",
}


def _template_text(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        return template
    if isinstance(template, dict):
        return "\n".join(t for t in template.values() if isinstance(t, str))
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        return "\n".join(t.get("template", "") for t in template if isinstance(t, dict))
    return ""


def detect_family(tokenizer: Any) -> str | None:
    """The tool-call family of a model, from its mlx-lm ``TokenizerWrapper`` or HF tokenizer.

    Uses the parser mlx-lm chose (``tokenizer.tool_parser``), then its start marker, then the
    chat template text; None when nothing points to a family.
    """
    parser = getattr(tokenizer, "tool_parser", None)
    module = getattr(parser, "__module__", "") or ""
    if module.startswith("mlx_lm.tool_parsers."):
        name = module.rsplit(".", 1)[1]
        return _MODULE_FAMILY.get(name, name)

    start = getattr(tokenizer, "tool_call_start", None)
    by_marker = {m.start: fam for fam, marks in _FAMILY_MARKUP.items() for m in marks}
    by_marker["<tool_call>"] = "hermes"
    if isinstance(start, str) and start in by_marker:
        return by_marker[start]

    renderer = getattr(tokenizer, "_chat_template", None)  # mlx-lm's own renderer modules
    if "deepseek" in (getattr(renderer, "__module__", "") or ""):
        return "deepseek"

    text = _template_text(tokenizer)
    if not text:
        return None
    try:  # mlx-lm's own inference from the template text (and the vocabulary, when there is one)
        from mlx_lm.tokenizer_utils import _infer_tool_parser

        get_vocab = getattr(tokenizer, "get_vocab", None)
        vocab = get_vocab() if callable(get_vocab) else {}
        name = _infer_tool_parser(SimpleNamespace(chat_template=text, get_vocab=lambda: vocab))
    except Exception:  # a private helper: tolerate it changing or failing
        name = None
    if name:
        return _MODULE_FAMILY.get(name, name)
    if "tool▁calls▁begin" in text or "tool▁call▁begin" in text or "｜DSML｜" in text:
        return "deepseek"
    if "<|tool_calls_section_begin|>" in text:
        return "kimi_k2"
    if ("<|tool_call>" in text and "<tool_call|>" in text) or "<start_function_call>" in text:
        return "gemma"
    if "<arg_key>" in text:
        return "glm"
    if "<tool_call>" in text and "<function=" in text:
        return "qwen3_coder"
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if (
        "<|python_tag|>" in text
        or '"parameters": dictionary of argument name' in text
        or "Environment: ipython" in text
    ):
        return "llama3"
    return None


def prompt_opens_reasoning(
    prompt_text: str, think_start: str | None = "<think>", think_end: str | None = "</think>"
) -> bool:
    """Whether the rendered prompt ends inside a think block (``starts_in_reasoning``).

    True when the last ``think_start`` comes after the last ``think_end`` - templates that
    open ``<think>`` in the generation prompt.
    """
    if not think_start or not think_end:
        return False
    start = prompt_text.rfind(think_start)
    return start >= 0 and start > prompt_text.rfind(think_end)


# --------------------------------------------------------------------------- the streaming parser


class _Channel:
    """Emits one delta type, holding back trailing whitespace until more text follows."""

    def __init__(self, cls: type, out: list):
        self.cls, self.out = cls, out
        self.ws = ""
        self.lstrip = False

    def emit(self, text: str) -> None:
        if not text:
            return
        if self.lstrip:
            text = text.lstrip()
            if not text:
                return
            self.lstrip = False
        text = self.ws + text
        body = text.rstrip()
        self.ws = text[len(body) :]
        if body:
            self.out.append(self.cls(body))

    def take_ws(self) -> str:
        ws, self.ws = self.ws, ""
        return ws

    def flush(self) -> None:
        if self.ws:
            self.out.append(self.cls(self.ws))
            self.ws = ""


_FENCE = "```"
_FENCE_LANGS = {
    "",
    "json",
    "jsonc",
    "json5",
    "tool_call",
    "tool_calls",
    "tool",
    "function_call",
    "tool_code",
}
_TEXT, _REASONING, _TOOL, _JSON, _FENCED = "text", "reasoning", "tool", "json", "fence"
_TAIL = 64  # longer than any end marker
_HEAD = 256  # a call candidate must show itself within this many characters


def _partial_suffix(text: str, markers: Iterable[str]) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class OutputParser:
    """Streaming parser of one generation; see the module notes for the rules."""

    def __init__(
        self,
        *,
        family: str | None,
        tools: list[dict] | None,
        reasoning: bool,
        think_start: str = "<think>",
        think_end: str = "</think>",
        starts_in_reasoning: bool = False,
    ):
        self.family = canonical_family(family)
        self._tools = normalize_tools(tools) or None
        self._names = {t["function"]["name"] for t in self._tools or []}
        self._fallbacks = bool(self._tools)
        self._markups = _markups_for(self.family) if self._tools else []
        self._reasoning = bool(reasoning and think_start and think_end)
        self._think_start, self._think_end = think_start, think_end

        # text-mode triggers: (marker, kind, markup)
        triggers: list[tuple[str, str, _Markup | None]] = [
            (m.start, "markup", m) for m in self._markups
        ]
        if self._reasoning:
            triggers += [(think_start, "think_start", None), (think_end, "think_end", None)]
        if self._fallbacks:
            triggers.append((_FENCE, "fence", None))
        self._triggers = triggers
        self._trigger_markers = [t[0] for t in triggers]

        self._out: list[Delta] = []
        self._text = _Channel(TextDelta, self._out)
        self._reason = _Channel(ReasoningDelta, self._out)
        self._reason.lstrip = True
        self._mode = _REASONING if (self._reasoning and starts_in_reasoning) else _TEXT
        self._reason_fresh = True  # nothing seen yet in the current think block
        self._buf = ""
        self._seg_start = True  # at the start of an answer segment (bare JSON may start here)
        self._after_json_call = False
        self._in_code_fence = False
        self._held_ws = ""  # whitespace before a candidate, given back if it is not a call
        # native tool region, or a bare JSON / fence candidate
        self._markup: _Markup | None = None
        self._acc_reset()
        self._head = ""
        self._depth = 0
        self._quote = ""
        self._escape = False
        self._plaus: bool | None = None
        self._fence_body = -1
        self._fence_lang = ""
        self._tool_calls: list[ToolCall] = []
        self._finished = False

    # ---------------------------------------------------------------- public

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self._tool_calls)

    def feed(self, text: str) -> list[Delta]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if text:
            self._buf += text
            self._run(final=False)
        return self._take()

    def finish(self) -> list[Delta]:
        if self._finished:
            return []
        for _ in range(1000):  # each round settles one open construct
            self._run(final=True)
            if self._mode == _TOOL:
                self._close_region(self._acc_text(), closed=False)
            elif self._mode == _JSON:
                self._release_candidate()
            elif self._mode == _FENCED:
                self._emit_text_verbatim(self._held_ws + self._acc_text())
                self._held_ws = ""
                self._acc_reset()
                self._mode = _TEXT
            if not self._buf and self._mode in (_TEXT, _REASONING):
                break
        if self._mode == _REASONING and self._buf:
            self._reason.emit(self._buf)
            self._buf = ""
        self._text.flush()
        self._reason.take_ws()
        self._finished = True
        return self._take()

    # ---------------------------------------------------------------- plumbing

    def _take(self) -> list[Delta]:
        merged: list[Delta] = []
        for delta in self._out:
            if merged and type(delta) is type(merged[-1]) and not isinstance(delta, ToolCall):
                merged[-1] = type(delta)(merged[-1].text + delta.text)
            else:
                merged.append(delta)
        self._out.clear()
        return merged

    def _run(self, final: bool) -> None:
        step = {
            _TEXT: self._step_text,
            _REASONING: self._step_reasoning,
            _TOOL: self._step_tool,
            _JSON: self._step_json,
            _FENCED: self._step_fence,
        }
        while step[self._mode](final):
            pass

    def _emit_calls(self, calls: list[ToolCall]) -> None:
        self._held_ws = ""
        self._out.extend(calls)
        self._tool_calls.extend(calls)
        self._text.lstrip = True
        self._seg_start = True

    def _emit_text_verbatim(self, text: str) -> None:
        self._text.emit(text)

    def _make_calls(self, parsed: Any, known: set[str] | None = None) -> list[ToolCall] | None:
        if parsed is None:
            return None
        calls = []
        for call in _as_list(parsed):
            if not isinstance(call, dict):
                return None
            name, args = call.get("name"), call.get("arguments")
            if not isinstance(name, str) or not name.strip():
                return None
            if name == "unknown" and isinstance(args, dict) and set(args) == {"raw"}:
                return None  # mlx-lm's glm47 parser gave up
            if known is not None and name.strip() not in known:
                return None
            model_id = call.get("id") if isinstance(call.get("id"), str) else None
            calls.append(ToolCall(new_call_id(), name.strip(), normalize_arguments(args), model_id))
        return calls or None

    # ---------------------------------------------------------------- text

    def _find_trigger(self, buf: str) -> tuple[int, tuple[str, str, _Markup | None] | None]:
        best_at, best = -1, None
        for trig in self._triggers:
            at = buf.find(trig[0])
            if at >= 0 and (
                best is None or at < best_at or (at == best_at and len(trig[0]) > len(best[0]))
            ):
                best_at, best = at, trig
        return best_at, best

    def _step_text(self, final: bool) -> bool:
        if not self._buf:
            return False
        if self._seg_start and self._fallbacks:
            buf = self._buf
            i = 0
            while i < len(buf) and (
                buf[i].isspace() or (self._after_json_call and buf[i] in ";}]")
            ):
                i += 1
            if i:
                lead = buf[:i]
                if not self._after_json_call:
                    self._text.emit(lead)
                buf = self._buf = buf[i:]
            if not buf:
                return False
            if not final and any(m.startswith(buf) and m != buf for m in self._trigger_markers):
                return False  # could still be a marker
            self._seg_start = False
            self._after_json_call = False
            if buf[0] in "{[" and not any(buf.startswith(m) for m in self._trigger_markers):
                self._held_ws = self._text.take_ws()
                self._mode, self._buf = _JSON, buf
                self._acc_reset()
                self._head, self._depth, self._plaus = "", 0, None
                self._quote, self._escape = "", False
                return True
        self._seg_start = False
        self._after_json_call = False

        buf = self._buf
        at, trig = self._find_trigger(buf)
        if trig is None:
            keep = 0 if final else _partial_suffix(buf, self._trigger_markers)
            self._text.emit(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        marker, kind, markup = trig
        self._text.emit(buf[:at])
        self._buf = buf[at + len(marker) :]
        if kind == "think_start":
            self._text.take_ws()
            self._mode = _REASONING
            self._reason.lstrip = True
            self._reason_fresh = True
        elif kind == "think_end":
            pass  # a stray close tag: drop it
        elif kind == "markup":
            self._held_ws = self._text.take_ws()
            self._mode, self._markup = _TOOL, markup
            self._acc_reset()
        elif kind == "fence":
            if self._in_code_fence:  # closes a plain code block
                self._text.emit(marker)
                self._in_code_fence = False
            else:
                self._held_ws = self._text.take_ws()
                self._mode, self._fence_body = _FENCED, -1
                self._acc_reset()
                self._acc_add(marker)
        return True

    # ---------------------------------------------------------------- reasoning

    def _step_reasoning(self, final: bool) -> bool:
        buf = self._buf
        if not buf:
            return False
        if self._reason_fresh:
            stripped = buf.lstrip()
            if not stripped:
                return False if not final else self._drop_buf()
            if stripped.startswith(self._think_start):  # the model repeated the opening tag
                self._buf = stripped[len(self._think_start) :]
                self._reason_fresh = False
                return True
            if not final and self._think_start.startswith(stripped):
                return False
            self._reason_fresh = False
        at = buf.find(self._think_end)
        if at >= 0:
            self._reason.emit(buf[:at])
            self._reason.take_ws()
            self._reason.lstrip = True
            self._buf = buf[at + len(self._think_end) :]
            self._mode = _TEXT
            self._text.take_ws()
            self._text.lstrip = True
            self._seg_start = True
            return True
        keep = 0 if final else _partial_suffix(buf, [self._think_end])
        self._reason.emit(buf[: len(buf) - keep])
        self._buf = buf[len(buf) - keep :]
        return False

    def _drop_buf(self) -> bool:
        self._buf = ""
        return False

    # ---------------------------------------------------------------- accumulated candidate text
    #
    # A tool region or a JSON/fence candidate can be long (a tool call that writes a file) and
    # arrives a token at a time, so it is kept as a list of pieces plus a short tail for marker
    # searches, and joined only when it is decided.

    def _acc_reset(self) -> None:
        self._parts: list[str] = []
        self._acc_len = 0
        self._tail = ""

    def _acc_add(self, text: str) -> tuple[int, str]:
        """Append; returns the previous length and tail (for searching across the seam)."""
        before, tail = self._acc_len, self._tail
        self._parts.append(text)
        self._acc_len += len(text)
        self._tail = (tail + text)[-_TAIL:]
        return before, tail

    def _acc_text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _acc_find_new(
        self, marker: str, before: int, tail: str, text: str, not_before: int = 0
    ) -> int:
        """Absolute position of the first ``marker`` that ends inside the newly added ``text``."""
        window = tail + text
        offset = before - len(tail)
        at = window.find(marker)
        while at >= 0 and (offset + at < not_before or at + len(marker) <= len(tail)):
            at = window.find(marker, at + 1)
        return offset + at if at >= 0 else -1

    def _take_buf(self) -> str:
        text, self._buf = self._buf, ""
        return text

    # ---------------------------------------------------------------- native tool markup

    def _step_tool(self, final: bool) -> bool:
        markup = self._markup
        assert markup is not None
        new = self._take_buf()
        if not new:
            return False
        before, tail = self._acc_add(new)
        if not markup.end:
            return False
        at = self._acc_find_new(markup.end, before, tail, new)
        if at < 0:
            return False
        region = self._acc_text()
        self._close_region(region[:at], closed=True)
        self._buf = region[at + len(markup.end) :] + self._buf
        return True

    def _close_region(self, inner: str, closed: bool) -> None:
        markup = self._markup
        assert markup is not None
        try:
            calls = self._make_calls(markup.parse(inner, self._tools))
        except Exception:  # mlx-lm parsers raise assorted errors on malformed text
            calls = None
        self._mode, self._markup = _TEXT, None
        self._acc_reset()
        if calls:
            self._emit_calls(calls)
        else:
            self._emit_text_verbatim(
                self._held_ws + markup.start + inner + (markup.end if closed else "")
            )
            self._held_ws = ""

    # ---------------------------------------------------------------- bare JSON at the start of the answer

    def _plausible(self) -> bool | None:
        """Can the candidate still be a call object/list? None while undecided."""
        sig = "".join(self._head.split())[:3]
        if not sig:
            return None
        if sig[0] == "{":
            return None if len(sig) < 2 else sig[1] in "\"'"
        if len(sig) < 2:
            return None
        if sig[1] != "{":
            return False
        return None if len(sig) < 3 else sig[2] in "\"'"

    def _step_json(self, final: bool) -> bool:
        new = self._take_buf()
        if not new:
            return False
        before, _ = self._acc_add(new)
        if self._plaus is None:
            if len(self._head) < _HEAD:
                self._head = (self._head + new)[:_HEAD]
            self._plaus = self._plausible()
            if self._plaus is None and len(self._head) >= _HEAD:
                self._plaus = False  # a brace followed by a wall of whitespace
        if self._plaus is False:
            self._release_candidate()
            return True
        end = -1
        for i, ch in enumerate(new):
            if self._quote:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == self._quote:
                    self._quote = ""
            elif ch in "\"'":
                self._quote = ch
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    end = before + i
                    break
        if end < 0:
            return False
        cand = self._acc_text()
        text, rest = cand[: end + 1], cand[end + 1 :]
        calls = None
        if self._plaus:
            try:
                calls = self._make_calls(self._json_calls(text), known=self._names)
            except ValueError:
                calls = None
        if calls:
            self._mode = _TEXT
            self._acc_reset()
            self._emit_calls(calls)
            self._after_json_call = True
            self._buf = rest + self._buf
        else:
            self._release_candidate()
        return True

    def _json_calls(self, text: str) -> list[dict] | None:
        calls = []
        for value in _json_values(text):
            got = _calls_from_json(value, self._names)
            if got is None:
                return None
            calls.extend(got)
        return calls

    def _release_candidate(self) -> None:
        """Not a call: give the candidate back to be read as plain text."""
        self._text.emit(self._held_ws)
        self._held_ws = ""
        self._buf = self._acc_text() + self._buf
        self._acc_reset()
        self._mode = _TEXT
        self._seg_start = False

    # ---------------------------------------------------------------- fenced blocks

    def _step_fence(self, final: bool) -> bool:
        new = self._take_buf()
        if not new:
            return False
        before, tail = self._acc_add(new)
        if self._fence_body < 0:
            cand = self._acc_text()
            nl = cand.find("\n", len(_FENCE))
            info = cand[len(_FENCE) : nl if nl >= 0 else len(cand)]
            if "`" in info or len(info) > _HEAD:  # inline ``` … ```, or no fence at all
                return self._fence_as_text(len(_FENCE), in_block=False)
            if nl < 0:
                return False
            lang = info.strip().lower()
            if lang not in _FENCE_LANGS:
                return self._fence_as_text(nl + 1, in_block=True)
            self._fence_lang, self._fence_body = lang, nl + 1
            close = cand.find(_FENCE, nl + 1)
        else:
            close = self._acc_find_new(_FENCE, before, tail, new, not_before=self._fence_body)
        if close < 0:
            return False
        cand = self._acc_text()
        body, whole, rest = (
            cand[self._fence_body : close],
            cand[: close + len(_FENCE)],
            cand[close + len(_FENCE) :],
        )
        calls = self._fence_calls(body)
        self._mode = _TEXT
        self._acc_reset()
        if calls:
            self._emit_calls(calls)
        else:
            self._emit_text_verbatim(self._held_ws + whole)
            self._held_ws = ""
        self._buf = rest + self._buf
        return True

    def _fence_calls(self, body: str) -> list[ToolCall] | None:
        stripped = body.strip()
        if any(m.start in stripped for m in self._markups):
            # native markup inside the fence: read the body on its own
            inner = OutputParser(family=self.family, tools=self._tools, reasoning=False)
            deltas = inner.feed(stripped) + inner.finish()
            if inner.tool_calls and all(
                isinstance(d, ToolCall) or not d.text.strip() for d in deltas
            ):
                return inner.tool_calls
            return None
        try:
            if self._fence_lang == "tool_code" or stripped[:1] not in ("{", "["):
                parsed = _pythonic_calls(stripped, self._tools)
            else:
                parsed = self._json_calls(stripped)
            return self._make_calls(parsed, known=self._names)
        except Exception:  # mlx-lm's pythonic parser raises assorted errors
            return None

    def _fence_as_text(self, upto: int, in_block: bool) -> bool:
        """A fence that is not a call candidate: pass its opening through as text."""
        cand = self._acc_text()
        self._emit_text_verbatim(self._held_ws + cand[:upto])
        self._held_ws = ""
        self._buf = cand[upto:] + self._buf
        self._acc_reset()
        self._mode = _TEXT
        self._in_code_fence = in_block
        return True


# --------------------------------------------------------------------------- one-shot helper


@dataclass
class ParsedOutput:
    text: str
    reasoning: str
    tool_calls: list[ToolCall]


def parse_output(text: str, **kwargs: Any) -> ParsedOutput:
    """Parse a complete output at once (same rules and arguments as :class:`OutputParser`)."""
    parser = OutputParser(**kwargs)
    deltas = parser.feed(text) + parser.finish()
    return ParsedOutput(
        text="".join(d.text for d in deltas if isinstance(d, TextDelta)),
        reasoning="".join(d.text for d in deltas if isinstance(d, ReasoningDelta)),
        tool_calls=parser.tool_calls,
    )
