"""The output formats each dialect asks for, as one `OutputFormat`, and their llguidance grammars.

OpenAI chat `response_format`, Responses `text.format`, Anthropic `output_config.format` and the
completions fields `json_schema`, `regex` and `grammar` (Lark) all become an `OutputFormat`; a
malformed one is a 400 naming the field. Every format is enforced: `omlx/engine/grammar.py` turns
it into a grammar (docs/design/structured-output.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from omlx.errors import InvalidRequestError

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class OutputFormat:
    """`kind`: "json" (`value`: a JSON schema), "regex" or "lark" (`value`: its text); `param`:
    the request field it came from, named in errors."""

    kind: str
    value: Any
    param: str


def _refuse(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message}", param=param)


def _object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _refuse(f"must be an object, got {type(value).__name__}.", param)
    return value


def _schema(value: Any, param: str) -> OutputFormat:
    if value is None:
        return OutputFormat("json", ANY_OBJECT, param)
    if isinstance(value, bool):  # `true` is a schema too: any JSON value
        return OutputFormat("json", {} if value else {"not": {}}, param)
    return OutputFormat("json", _object(value, param), param)


def _typed(value: Any, param: str, schema_key: str | None) -> OutputFormat | None:
    """The shared shape: {"type": "text" | "json_object" | "json_schema", …}."""
    if value is None:
        return None
    value = _object(value, param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat("json", ANY_OBJECT, param)
    if kind == "json_schema":
        holder = value if schema_key is None else _object(value.get(schema_key), f"{param}.{schema_key}")
        where = f"{param}.schema" if schema_key is None else f"{param}.{schema_key}.schema"
        return _schema(holder.get("schema"), where)
    raise _refuse(f"type must be 'text', 'json_object' or 'json_schema', got {json.dumps(kind)[:40]}.", f"{param}.type")


def openai_response_format(value: Any) -> OutputFormat | None:
    """Chat completions' `response_format`: json_object, or json_schema (strict or not: always
    enforced) with its schema in `json_schema.schema`."""
    return _typed(value, "response_format", "json_schema")


def responses_text_format(text: Any) -> OutputFormat | None:
    """The Responses API's `text.format` (the schema sits in the format itself)."""
    if text is None:
        return None
    return _typed(_object(text, "text").get("format"), "text.format", None)


def anthropic_output_format(output_config: Any, output_format: Any = None) -> OutputFormat | None:
    """Anthropic's `output_config.format` ({"type": "json_schema", "schema": …}), or the older
    top-level `output_format` of the same shape."""
    if output_config is not None:
        found = _typed(_object(output_config, "output_config").get("format"), "output_config.format", None)
        if found is not None:
            return found
    return _typed(output_format, "output_format", None)


def completion_format(json_schema: Any, regex: Any, grammar: Any) -> OutputFormat | None:
    """The completions endpoint's `json_schema`, `regex` or `grammar` (Lark): one at most."""
    given = {k: v for k, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar)) if v is not None}
    if len(given) > 1:
        raise _refuse(f"give one of json_schema, regex and grammar, not {' and '.join(given)}.", next(iter(given)))
    if json_schema is not None:
        return _schema(json_schema, "json_schema")
    for name, kind in (("regex", "regex"), ("grammar", "lark")):
        value = given.get(name)
        if value is not None:
            if not isinstance(value, str) or not value:
                raise _refuse("must be a non-empty string.", name)
            return OutputFormat(kind, value, name)
    return None
