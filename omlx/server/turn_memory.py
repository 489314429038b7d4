"""The assistant turns the server generated recently, kept as generated (text and token ids), so
that the next request of the conversation renders each of them byte for byte and token for
token, and the prefix cache restores the whole previous prompt and answer
(docs/design/agent-prefixes.md).

A client sends an assistant turn back as its API shows it: visible text, tool calls, maybe
reasoning. That loses what the model really printed (tool-call markup, whitespace, an empty
think block, reasoning the client dropped) and how it was tokenized. A turn is found again by
the ids of the calls it made (issued by this server, unique) or, without calls, by its text
and the message it answered; it is used only when what the client sent matches what it was
given (a client that edited the turn gets its edit).
"""

from __future__ import annotations

import hashlib
import json
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from omlx.api.tool_calls import ToolCall

MAX_TURNS = 4096
MAX_TOKENS = 4_000_000  # all turns' token ids together (16 MB as int32)


def call_key(call_id: Any) -> str | None:
    """The hex part every API's id of one call shares (`call_…`, `toolu_…`)."""
    if not isinstance(call_id, str) or "_" not in call_id:
        return None
    return call_id.rsplit("_", 1)[1] or None


def _canonical_args(value: Any) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            value = {"_raw": value}
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def _shown_calls(calls: list[ToolCall]) -> tuple[tuple[str, str], ...]:
    """The calls as the client was given them (arguments that are not an object: `_raw`)."""
    return tuple((c.name, _canonical_args({"_raw": c.arguments} if c.problem else c.arguments)) for c in calls)


def _sent_calls(message: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            out.append((str(fn.get("name")), _canonical_args(fn.get("arguments"))))
    return tuple(out)


def _text(content: Any) -> str:
    return content if isinstance(content, str) else ""


def _text_key(model: str, answered: str, content: str) -> str:
    digest = hashlib.sha256(f"{model}\0{answered}\0{content.strip()}".encode()).hexdigest()
    return "t:" + digest


def _answered(messages: list[dict[str, Any]], index: int) -> str:
    """The content of the last message before `index` that is not the assistant's."""
    for message in reversed(messages[:index]):
        if message.get("role") != "assistant":
            return _text(message.get("content"))
    return ""


@dataclass(frozen=True)
class GeneratedTurn:
    text: str  # the generated text, as the model printed it
    tokens: array  # its token ids (end-of-sequence excluded)
    content: str  # the visible text the client was given
    calls: tuple[tuple[str, str], ...]  # (name, canonical arguments) as the client was given them


class TurnMemory:
    """Thread-safe and bounded (`MAX_TURNS` turns, `MAX_TOKENS` token ids; least recently used
    go first)."""

    def __init__(self, max_turns: int = MAX_TURNS, max_tokens: int = MAX_TOKENS):
        self.max_turns, self.max_tokens = max_turns, max_tokens
        self._turns: OrderedDict[str, GeneratedTurn] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def remember(self, model: str, messages: list[dict[str, Any]], text: str, tokens: list[int],
                 content: str, calls: list[ToolCall]) -> None:
        """A generation that answered `messages` (as the client sent them)."""
        if not text or not tokens:
            return
        turn = GeneratedTurn(text, array("i", tokens), content, _shown_calls(calls))
        keys = [f"c:{model}:{call_key(c.id)}" for c in calls] or [_text_key(model, _answered(messages, len(messages)), content)]
        with self._lock:
            for key in keys:
                old = self._turns.pop(key, None)
                if old is not None:
                    self._tokens -= len(old.tokens)
                self._turns[key] = turn
                self._tokens += len(turn.tokens)
            while self._turns and (len(self._turns) > self.max_turns or self._tokens > self.max_tokens):
                _, gone = self._turns.popitem(last=False)
                self._tokens -= len(gone.tokens)

    def recall(self, model: str, messages: list[dict[str, Any]], index: int) -> GeneratedTurn | None:
        """The generated turn behind assistant message `index`, if the client sent it back unchanged."""
        message = messages[index]
        sent = _sent_calls(message)
        ids = [call_key(c.get("id")) for c in message.get("tool_calls") or [] if isinstance(c, dict)]
        key = f"c:{model}:{ids[0]}" if ids and ids[0] else None
        if key is None and not sent:
            key = _text_key(model, _answered(messages, index), _text(message.get("content")))
        if key is None:
            return None
        with self._lock:
            turn = self._turns.get(key)
            if turn is not None:
                self._turns.move_to_end(key)
        if turn is None or turn.calls != sent or turn.content.strip() != _text(message.get("content")).strip():
            return None
        return turn

    def __len__(self) -> int:
        return len(self._turns)


def answer_prefill(tokenizer: Any, template_kwargs: dict[str, Any]) -> str:
    """What the template's generation prompt puts inside the answer before the model writes
    (`<think>\\n` for a template that opens reasoning), so that a turn is sent back to the
    template as that plus what the model wrote; "" when the template shows none."""
    from omlx.api.chat_template import render_text

    user = [{"role": "user", "content": "x"}]
    marker = "\x00omlx-answer\x00"
    try:
        before = render_text(tokenizer, user, template_kwargs=template_kwargs, add_generation_prompt=False)
        opened = render_text(tokenizer, user, template_kwargs=template_kwargs)
        answered = render_text(tokenizer, [*user, {"role": "assistant", "content": marker}],
                               template_kwargs=template_kwargs, add_generation_prompt=False)  # fmt: skip
    except Exception:  # a template that refuses the probe: nothing to learn from it
        return ""
    if not (opened.startswith(before) and answered.startswith(before) and marker in answered):
        return ""
    generation, header = opened[len(before):], answered[len(before):answered.index(marker)]
    return generation[len(header):] if generation.startswith(header) else ""
