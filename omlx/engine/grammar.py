"""Grammars compiled with llguidance against a model's tokenizer, once per request.

llguidance is a core dependency where it has wheels (Linux x86-64, macOS arm64); elsewhere
every constrained request is refused with a 400 that names the package. Compiling does no MLX
work: it runs off the event loop (`asyncio.to_thread`), before the request reaches the engine.
"""

from __future__ import annotations

import contextlib
import json
import threading
import weakref
from typing import Any

from omlx.errors import InvalidRequestError

MISSING = (
    "Structured output (response formats, grammars, forced tool calls and thinking budgets) needs "
    "the 'llguidance' package, which is not installed here: it has wheels for Linux x86-64 and "
    "macOS arm64 (`pip install 'llguidance>=1.9,<2'`)."
)

# JSON is written as `json.dumps` writes it: no free whitespace, which a small model can
# otherwise fill until its token budget runs out.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_tokenizers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def llguidance() -> Any:
    """The llguidance module, or a 400 naming the missing package."""
    try:
        import llguidance as module
    except ImportError:
        raise InvalidRequestError(MISSING, code="llguidance_missing") from None
    return module


def ll_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: list[int], model_id: str) -> Any:
    """llguidance's view of a model's tokenizer (built once per tokenizer, ~0.25 s at a 49k
    vocabulary), or a 400 when it cannot be mapped. Every id in `eos_ids` ends the output."""
    with _lock:
        found = _cached(tokenizer)
        if found is not None:
            return found
        llguidance()  # or the 400 naming the package
        from llguidance.hf import from_tokenizer
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        hf = tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer  # the HF tokenizer
        try:
            mapped = from_tokenizer(hf, n_vocab=vocab_size, eos_token=sorted(eos_ids) or None)
        except Exception as exc:  # any failure to map it is the model's limit, reported as such
            raise InvalidRequestError(
                f"Structured output is not available for model '{model_id}': its tokenizer cannot be "
                f"mapped for constrained decoding ({type(exc).__name__}: {str(exc)[:200]}).",
                param="model",
                code="tokenizer_unsupported",
            ) from None
        with contextlib.suppress(TypeError):  # kept while the tokenizer lives, where it can be
            _tokenizers[tokenizer] = mapped
        return mapped


def _cached(tokenizer: Any) -> Any:
    try:
        return _tokenizers.get(tokenizer)
    except TypeError:  # no weak reference to it: never cached
        return None


def compile_grammar(lltok: Any, grammar: str, param: str) -> Any:
    """A fresh `LLMatcher` for the llguidance grammar text `grammar`, or a 400 naming `param` and
    what llguidance could not compile (an invalid schema, regex or Lark, or an unsupported feature)."""
    module = llguidance()
    try:
        failed, messages = module.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
        if failed:
            raise InvalidRequestError(f"{param}: cannot be enforced: {_first_lines(messages[0])}", param=param)
        matcher = module.LLMatcher(lltok, grammar, log_level=0)
    except BaseException as exc:  # a panic in llguidance's Rust is a BaseException: refuse the request
        if type(exc).__name__ != "PanicException":
            raise
        raise InvalidRequestError(f"{param}: cannot be enforced: llguidance failed ({_first_lines(str(exc))})",
                                  param=param) from None
    if matcher.is_error():
        raise InvalidRequestError(f"{param}: cannot be enforced: {_first_lines(matcher.get_error())}", param=param)
    return matcher


def _first_lines(message: str, limit: int = 600) -> str:
    return message.strip()[:limit]


def json_with_options(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` closed (`closed_objects`) with `JSON_OPTIONS` as its llguidance options (its own,
    if any, win)."""
    own = schema.get("x-guidance")
    return {**closed_objects(schema), "x-guidance": {**JSON_OPTIONS, **(own if isinstance(own, dict) else {})}}


# keywords that combine schemas by intersection or negation: closing an object under them could
# let an output through that the schema refuses, so such schemas are left as they are
_COMBINING = ("not", "if", "oneOf", "allOf", "dependentSchemas", "dependencies", "unevaluatedProperties")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties", "contains")


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` where an object that lists its properties and says nothing of others
    allows none: every output still validates against `schema`, and a small model cannot add
    invented keys until its token budget runs out. Schemas that intersect or negate are kept."""
    return schema if _combines(schema) else _closed(schema)


def _combines(schema: Any) -> bool:
    if isinstance(schema, list):
        return any(_combines(s) for s in schema)
    if not isinstance(schema, dict):
        return False
    if any(k in schema for k in _COMBINING) or ("$ref" in schema and len(schema) > 1):
        return True
    return any(_combines(v) for v in schema.values() if isinstance(v, dict | list))


def _closed(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub) for name, sub in out[key].items()}
    for key in (*_SCHEMA_LISTS, *_SCHEMAS):
        if isinstance(out.get(key), list):
            out[key] = [_closed(sub) for sub in out[key]]
        elif key in out:
            out[key] = _closed(out[key])
    open_keys = ("additionalProperties", "patternProperties")
    if isinstance(out.get("properties"), dict) and not any(k in out for k in open_keys):
        out["additionalProperties"] = False
    return out


def format_grammar(kind: str, value: Any, param: str) -> str:
    """The llguidance grammar text enforcing an output format: `kind` "json" (`value`: a JSON
    schema), "regex" or "lark" (`value`: its text); a 400 naming `param` if it cannot be read."""
    matcher = llguidance().LLMatcher
    if kind == "json":
        try:
            return matcher.grammar_from_json_schema(json_with_options(value))
        except ValueError as exc:
            raise InvalidRequestError(f"{param}: not a JSON schema llguidance can read: {exc}", param=param) from None
    if kind == "regex":
        return matcher.grammar_from_regex(value)
    return matcher.grammar_from_lark(value)


def token_marker(lltok: Any) -> Any:
    """A function writing marker text as Lark: each special token the tokenizer makes of it as
    `<[id]>` (text never produces one), the rest as string literals."""

    def marker(text: str) -> str:
        parts: list[str] = []
        run: list[int] = []
        for token in lltok.tokenize_str(text, parse_special=True):
            if lltok.is_special_token(token):
                if run:
                    parts.append(json.dumps(lltok.decode_str(run), ensure_ascii=False))
                    run = []
                parts.append(f"<[{token}]>")
            else:
                run.append(token)
        if run:
            parts.append(json.dumps(lltok.decode_str(run), ensure_ascii=False))
        return " ".join(parts)

    return marker
