"""Tool calling for chat templates that know nothing about tools.

Some models ship a template that never renders ``tools`` (SmolLM2's ChatML, many small
instruct models). For those, :func:`inject_tools_into_system` describes the offered tools in
the system message and asks for calls as ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``;
the answer is then read with the ``hermes`` family of :mod:`omlx.api.output_parser` (whose
bare-JSON and fenced fallbacks also catch the small models that drop the tags).

The same function rewrites earlier tool turns into plain text, since such templates cannot
render them either: an assistant message's ``tool_calls`` become ``<tool_call>`` blocks in its
content, and ``tool`` messages become a ``user`` message of ``<tool_response>`` blocks.
"""

from __future__ import annotations

import json
import re
from typing import Any

from omlx.api.tool_calls import normalize_tools

__all__ = ["template_supports_tools", "inject_tools_into_system", "tools_system_text"]

_TOOLS_WORD = re.compile(r"\btools\b")


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders the ``tools`` it is given.

    True when the template text mentions ``tools``, or when mlx-lm renders the prompt with its
    own template module (those are written for tool use); False without a template.
    """
    renderer = getattr(tokenizer, "_chat_template", None)  # mlx-lm TokenizerWrapper's own renderer
    if callable(renderer):
        return True
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        texts = [t for t in template.values() if isinstance(t, str)]
    elif isinstance(template, list):
        texts = [t.get("template", "") for t in template if isinstance(t, dict)]
    elif isinstance(template, str):
        texts = [template]
    else:
        texts = []
    return any(_TOOLS_WORD.search(t) for t in texts)


def tools_system_text(tools: list[dict]) -> str:
    """The instructions and tool descriptions that go into the system message."""
    specs = [t["function"] for t in normalize_tools(tools)]
    lines = [
        "# Tools",
        "",
        "You can call the following tools (functions). Each is given with its name, what it does "
        "and a JSON Schema of its arguments:",
        "",
    ]
    for spec in specs:
        lines.append(f"## {spec['name']}")
        if spec.get("description"):
            lines.append(str(spec["description"]).strip())
        lines.append(
            "Arguments schema: " + json.dumps(spec.get("parameters") or {}, ensure_ascii=False)
        )
        lines.append("")
    example = specs[0]["name"] if specs else "tool_name"
    lines += [
        "To call a tool, answer with exactly this and nothing else:",
        "<tool_call>",
        '{"name": "<tool name>", "arguments": {<arguments as a JSON object>}}',
        "</tool_call>",
        "",
        f'For example: <tool_call>{{"name": "{example}", "arguments": {{...}}}}</tool_call>',
        "Use one <tool_call> block per call; several blocks call several tools. Only use the tools "
        "listed above, with arguments that match their schema. The results come back in "
        "<tool_response> blocks. If no tool is needed, answer normally without <tool_call>.",
    ]
    return "\n".join(lines)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "".join(parts)
    return str(content)


def _call_text(call: dict) -> str:
    fn = call.get("function") if isinstance(call.get("function"), dict) else call
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            args = {"_raw": args}
    payload = {"name": fn.get("name"), "arguments": args if args is not None else {}}
    return "<tool_call>\n" + json.dumps(payload, ensure_ascii=False) + "\n</tool_call>"


def inject_tools_into_system(
    messages: list[dict[str, Any]], tools: list[dict] | None
) -> list[dict[str, Any]]:
    """A copy of ``messages`` with the tools described in the system message.

    The description is appended to the first message when it is a system message, or put in a
    new system message at the front. Earlier tool turns are rewritten as plain text (see the
    module notes). Without tools the messages are returned unchanged (copied).
    """
    if not normalize_tools(tools):
        return [dict(m) for m in messages]
    block = tools_system_text(tools or [])
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            text = _text(message.get("content")).strip()
            calls = "\n".join(_call_text(c) for c in message["tool_calls"] if isinstance(c, dict))
            new = {k: v for k, v in message.items() if k != "tool_calls"}
            new["content"] = f"{text}\n{calls}" if text else calls
            out.append(new)
        elif role == "tool":
            response = "<tool_response>\n" + _text(message.get("content")) + "\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("_omlx_tool_results"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "_omlx_tool_results": True})
        else:
            out.append(dict(message))
    for message in out:
        message.pop("_omlx_tool_results", None)

    if out and out[0].get("role") == "system":
        system = _text(out[0].get("content")).rstrip()
        out[0]["content"] = f"{system}\n\n{block}" if system else block
    else:
        out.insert(0, {"role": "system", "content": block})
    return out
