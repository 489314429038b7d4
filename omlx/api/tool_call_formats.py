"""Tool-call formats: each model family's markup, the parsers for the text inside it, and
detection of a model's family from its tokenizer.

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
"""

from __future__ import annotations

import functools
import importlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from omlx.api.tool_calls import calls_from_json, json_values

__all__ = [
    "FAMILIES", "Markup", "canonical_family", "detect_family", "markups_for", "prompt_opens_reasoning",
    "salvage_calls",
]  # fmt: skip


# --------------------------------------------------------------------------- per-family parsers
#
# Each takes the text between a start and an end marker (and the offered tools, OpenAI shape)
# and returns a list of {"name", "arguments", "id"?} dicts, raising on failure.


@functools.cache
def _mlx_parser(module: str):
    return importlib.import_module(f"mlx_lm.tool_parsers.{module}")


def as_list(parsed: Any) -> list:
    return parsed if isinstance(parsed, list) else [parsed]


def _parse_with_mlx(module: str) -> Callable[[str, list | None], list[dict]]:
    def parse(inner: str, tools: list | None) -> list[dict]:
        return as_list(_mlx_parser(module).parse_tool_call(inner, tools))

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
            values = json_values(text)
        calls = []
        for value in values:
            got = calls_from_json(value, None)
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
        parsed = as_list(parser.parse_tool_call(_CALL_ID.sub("", piece), tools))
        if ids and len(ids) == len(parsed):
            for call, call_id in zip(parsed, ids, strict=True):
                call.setdefault("id", call_id)
        calls.extend(parsed)
    if not calls:
        raise ValueError("no tool call after [TOOL_CALLS]")
    return calls


_PRINT_CALL = re.compile(r"print\((.*)\)\s*$", re.DOTALL)


def pythonic_calls(code: str, tools: list | None) -> list[dict]:
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
            return as_list(parser.parse_tool_call(candidate, tools))
        except (ValueError, SyntaxError) as exc:
            last_error = exc
    raise last_error


_BUILTIN_CALL = re.compile(r"([\w.]+?)\.call\((.*)\)\s*$", re.DOTALL)


def _parse_llama3(inner: str, tools: list | None) -> list[dict]:
    text = inner.replace("<|eom_id|>", "").replace("<|eot_id|>", "").strip()
    if text[:1] in ("{", "["):
        calls = []
        for value in json_values(text):
            got = calls_from_json(value, None)
            if got is None:
                raise ValueError("not a tool call object")
            calls.extend(got)
        return calls
    match = _BUILTIN_CALL.match(text)  # built-in tool: brave_search.call(query="...")
    if match:
        return pythonic_calls(f"{match.group(1)}({match.group(2)})", tools)
    return pythonic_calls(text, tools)


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


# --------------------------------------------------------------------------- broken calls
#
# A call whose arguments are not valid JSON is still a call: the name and the arguments as
# generated go to the client, whose own validation tells the model what to fix.

_CALL_BEGINS = ("<tool_call>", "<｜tool▁call▁begin｜>", "<|tool_call_begin|>", "[TOOL_CALLS]")
_CALL_ENDS = (
    "</tool_call>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>", "<|tool_call_end|>",
    "<|tool_calls_section_end|>", "<tool_call|>", "<end_function_call>",
)  # fmt: skip
_JSON_NAME = re.compile(r'^\s*\{\s*["\']name["\']\s*:\s*["\']([^"\'\\]{1,128})["\']\s*,\s*'
                        r'["\'](?:arguments|parameters)["\']\s*:\s*(.*)$', re.DOTALL)
_NAME_FIRST = re.compile(
    r"^\s*(?:function\s*<｜tool▁sep｜>\s*)?(?:call:|functions\.)?([\w.\-]{1,128}?)(?::\d+)?\s*"
    r"(?:\[CALL_ID\]\s*[\w-]+\s*)?(?:\[ARGS\]|<｜tool▁sep｜>|<\|tool_call_argument_begin\|>)?\s*"
    r"(?:```\w*\s*)?([{\[].*)$",
    re.DOTALL,
)


def _salvage_one(piece: str, names: set[str]) -> dict | None:
    for end in _CALL_ENDS:
        piece = piece.replace(end, "")
    piece = piece.strip()
    match = _JSON_NAME.match(piece)
    if match:
        name, args = match.group(1), match.group(2).rstrip()
        if args.endswith("}"):  # the envelope's own closing brace
            args = args[:-1].rstrip().rstrip(",").rstrip()
    else:
        match = _NAME_FIRST.match(piece)
        if not match:
            return None
        name, args = match.group(1), match.group(2).strip().removesuffix("```").rstrip()
    if name not in names:
        return None
    return {"name": name, "arguments": args}


def salvage_calls(text: str, names: set[str]) -> list[dict] | None:
    """Calls of offered tools (`names`) from markup no parser could read, their arguments as
    generated; None when some piece names no offered tool."""
    pieces = [text]
    for begin in _CALL_BEGINS:
        pieces = [part for piece in pieces for part in piece.split(begin)]
    calls = []
    for piece in pieces:
        if not piece.strip():
            continue
        call = _salvage_one(piece, names)
        if call is None:
            return None
        calls.append(call)
    return calls or None


# --------------------------------------------------------------------------- is it a call?
#
# A marker quoted in prose ("wrap each call in <tool_call> tags") must not swallow the answer:
# what follows a start marker is checked as it arrives; True: a call, False: prose, None: not
# decided yet.

Verdict = bool | None
_NAME_CHARS = re.compile(r"[\w.\-:]*")


def _opens_with(head: str, starts: tuple[str, ...]) -> Verdict:
    text = head.lstrip()
    if not text:
        return None
    if any(text.startswith(s) for s in starts):
        return True
    if any(s.startswith(text) for s in starts):
        return None
    return False


def _json_head(head: str) -> Verdict:
    """hermes / qwen3_coder ``<tool_call>``: a JSON object (or list) or a ``<function=`` block."""
    return _opens_with(head, ("{", "[", "<function="))


def _function_head(head: str) -> Verdict:
    """``<function=NAME>``."""
    name = _NAME_CHARS.match(head)
    end = name.end() if name else 0
    if end == len(head):
        return None
    return end > 0 and head[end] == ">"


def _name_then(head: str, follows: tuple[str, ...]) -> Verdict:
    """A tool name right away, then one of `follows` (or a JSON object / list)."""
    text = head.lstrip()
    name = _NAME_CHARS.match(text)
    end = name.end() if name else 0
    if text[:1] in ("{", "["):
        return True
    if end == len(text):
        return None
    if end == 0:
        return False
    rest = text[end:]
    if any(rest.startswith(f) for f in follows):
        return True
    if any(f.startswith(rest) for f in follows):
        return None
    return False


def _glm_head(head: str) -> Verdict:
    return _name_then(head, ("\n", "<arg_key>", "</tool_call>", "{"))


def _mistral_head(head: str) -> Verdict:
    return _name_then(head, ("[ARGS]", "[CALL_ID]"))


def _gemma_head(head: str) -> Verdict:
    return _opens_with(head, ("call:",))


@dataclass(frozen=True)
class Markup:
    start: str
    end: str  # "" = the calls run to the end of the output
    parse: Callable[[str, list | None], list[dict]]
    # whether what follows `start` is a call (see above); None: any text after `start` is one
    plausible: Callable[[str], Verdict] | None = None


_HERMES = [Markup("<tool_call>", "</tool_call>", _tag_parser(glm=False), _json_head)]

_FAMILY_MARKUP: dict[str, list[Markup]] = {
    "hermes": _HERMES,
    "qwen3_coder": [
        Markup("<tool_call>", "</tool_call>", _tag_parser(glm=False), _json_head),
        Markup("<function=", "</function>", _parse_bare_function, _function_head),
    ],
    "glm": [Markup("<tool_call>", "</tool_call>", _tag_parser(glm=True), _glm_head)],
    "llama3": [Markup("<|python_tag|>", "", _parse_llama3)],
    "mistral": [Markup("[TOOL_CALLS]", "", _parse_mistral, _mistral_head)],
    "gemma": [
        Markup("<|tool_call>", "<tool_call|>", _parse_with_mlx("gemma4"), _gemma_head),
        Markup("<start_function_call>", "<end_function_call>", _parse_with_mlx("function_gemma"), _gemma_head),
    ],
    "deepseek": [
        Markup("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", _parse_deepseek),
        Markup("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", _parse_deepseek),
        Markup("<｜DSML｜function_calls>", "</｜DSML｜function_calls>", _parse_dsml),
        Markup("<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>", _parse_dsml),
    ],
    "kimi_k2": [
        Markup(
            "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", _parse_with_mlx("kimi_k2")
        ),
        Markup("<|tool_call_begin|>", "<|tool_call_end|>", _parse_with_mlx("kimi_k2")),
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


def markups_for(family: str | None) -> list[Markup]:
    if family is None:
        return _HERMES
    if family in _FAMILY_MARKUP:
        return _FAMILY_MARKUP[family]
    module = _mlx_parser(family)
    return [Markup(module.tool_call_start, module.tool_call_end or "", _parse_with_mlx(family))]


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
