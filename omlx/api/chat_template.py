"""Render chat messages to token ids with the model's own chat template.

Messages arrive here as plain dicts in the HF chat format (role, content text,
tool_calls, tool_call_id); each API converts its wire messages to that first.
"""

from __future__ import annotations

import json
from typing import Any

from omlx.api.media import DOCUMENT_KINDS, IMAGE_KINDS, MediaPolicy
from omlx.api.tool_specs import tool_name
from omlx.errors import InvalidRequestError

TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def content_text(content: Any, param: str, media: MediaPolicy, in_tool_result: bool = False) -> str:
    """Flatten OpenAI / Responses content parts to text: images and files follow `media` (a
    vision model's image mark; else a placeholder inside a tool result, else a 400), parts of
    unknown types are dropped."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"{param}: content must be a string or a list of content parts, got {type(content).__name__}.", param=param
        )
    out = []
    for j, part in enumerate(content):
        where = f"{param}.{j}"
        if isinstance(part, str):
            out.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            shown = type(part).__name__ if not isinstance(part, dict) else "an object without a 'type' string"
            raise InvalidRequestError(f"{where}: each content part must be a string or an object with a 'type' "
                                      f"string, got {shown}.", param=where)  # fmt: skip
        if kind in TEXT_PARTS:
            text = part.get(TEXT_PARTS[kind], "")
            if not isinstance(text, str):
                raise InvalidRequestError(f"{where}.{TEXT_PARTS[kind]} must be a string.", param=f"{where}.{TEXT_PARTS[kind]}")
            out.append(text)
        elif kind in IMAGE_KINDS:
            out.append(media.image(kind, part, where, in_tool_result))
        elif kind in DOCUMENT_KINDS:
            if not in_tool_result:
                raise media.refuse(kind, where)
            out.append(media.placeholder(kind, where))
        else:
            media.drop(kind, where)
    return "".join(out)


def render_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The conversation rendered by the model's chat template, as text (a 400 when the template
    refuses it)."""
    if getattr(tokenizer, "chat_template", None) is None:
        text = "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "")
    kwargs = dict(template_kwargs or {})
    try:
        return tokenizer.apply_chat_template(
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


def encode(tokenizer: Any, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        return list(tokenizer.encode(text))
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of the rendered conversation, ready for generation."""
    text = render_text(tokenizer, messages, tools=tools, template_kwargs=template_kwargs,
                       add_generation_prompt=add_generation_prompt)  # fmt: skip
    return encode(tokenizer, text)


TURN_MARK = "\x00omlx-turn-{}\x00"  # placed before a generated turn to find it in the rendered text


def encode_spliced(tokenizer: Any, marked: str, turns: list[tuple[str, list[int]]]) -> tuple[list[int], list[int]]:
    """Token ids of a rendered text in which generated turn k is preceded by `TURN_MARK.format(k)`
    (the marks are removed): where the text after its mark is the turn's text (generated text, its
    token ids), those ids are kept, and the text around them is encoded in pieces, the first
    piece ending where the previous prompt ended. Also returns the indices of the turns that are
    not there verbatim (a template that rewrote them: encoded as text)."""
    pieces: list[str] = []
    spans: list[tuple[int, int]] = []  # (k, start in the text without marks)
    at, length = 0, 0
    for k in range(len(turns)):
        found = marked.find(TURN_MARK.format(k), at)
        if found < 0:
            continue
        pieces.append(marked[at:found])
        length += found - at
        spans.append((k, length))
        at = found + len(TURN_MARK.format(k))
    pieces.append(marked[at:])
    text = "".join(pieces)
    ids: list[int] = []
    done = 0
    kept = set()
    for k, start in spans:
        turn_text, turn_ids = turns[k]
        if start < done or not turn_text or not text.startswith(turn_text, start):
            continue
        ids += encode(tokenizer, text[done:start]) + list(turn_ids)
        done = start + len(turn_text)
        kept.add(k)
    return ids + encode(tokenizer, text[done:]), [k for k in range(len(turns)) if k not in kept]


def normalize_tool_calls(tool_calls: list[Any] | None, param: str) -> list[dict[str, Any]] | None:
    """An assistant turn's OpenAI tool calls, checked, with `arguments` as templates expect
    them: a dict (clients send a JSON string; one that does not parse is kept as `_raw`)."""
    if not tool_calls:
        return None
    out = []
    for k, call in enumerate(tool_calls):
        where = f"{param}.{k}"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise InvalidRequestError(f"{where}.function must be an object with 'name' and 'arguments'.",
                                      param=f"{where}.function")
        fn = dict(fn)
        tool_name(fn.get("name"), f"{where}.function.name")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                fn["arguments"] = {"_raw": args}
        elif args is None:
            fn["arguments"] = {}
        elif not isinstance(args, dict):
            raise InvalidRequestError(f"{where}.function.arguments must be a JSON string or an object.",
                                      param=f"{where}.function.arguments")
        out.append({"id": call.get("id"), "type": "function", "function": fn})
    return out
