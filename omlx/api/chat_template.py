"""Render chat messages to token ids with the model's own chat template.

Messages arrive here as plain dicts in the HF chat format (role, content text,
tool_calls, tool_call_id); each API converts its wire messages to that first.
"""

from __future__ import annotations

import json
from typing import Any

from omlx.errors import InvalidRequestError


def content_text(content: Any, param: str = "messages") -> str:
    """Flatten OpenAI/Anthropic content parts to text; non-text parts are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text"):
                out.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequestError(
                    f"Content part of type '{kind}' is not supported by this text model.", param=param
                )
        return "".join(out)
    raise InvalidRequestError("content must be a string or a list of content parts", param=param)


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of the rendered conversation, ready for generation."""
    if getattr(tokenizer, "chat_template", None) is None:
        text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages) + "assistant:"
        return list(tokenizer.encode(text))
    kwargs = dict(template_kwargs or {})
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
    except Exception as exc:  # jinja raises arbitrary errors for conversations a template refuses
        raise InvalidRequestError(
            f"The model's chat template could not render these messages: {exc}", param="messages"
        ) from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def normalize_tool_calls(tool_calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Templates expect `arguments` as a dict; OpenAI clients send a JSON string."""
    if not tool_calls:
        return None
    out = []
    for call in tool_calls:
        fn = dict(call.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                fn["arguments"] = {"_raw": args}
        out.append({"id": call.get("id"), "type": "function", "function": fn})
    return out
