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

The formats themselves (one per model family) are in :mod:`omlx.api.tool_call_formats`.

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
* ``arguments`` is the text of a JSON object: ``"{}"`` when a call has none, arguments given
  as a JSON string are decoded and re-serialized. Arguments that are not a JSON object
  (invalid JSON, a list, a number) are kept as generated, with ``ToolCall.problem`` saying so:
  the call is still a call, and the client's validation reports the problem to the model.
* A call never vanishes silently. Markup no parser reads but whose pieces name offered tools is
  salvaged into calls (arguments as generated); an envelope still open when the output ends is
  closed and parsed; what cannot be read either way is given back as text, verbatim, and
  :attr:`OutputParser.warnings` names the problem (``tool_call_unclosed``,
  ``tool_call_unparsed``, ``tool_arguments_invalid``); a strictly call-shaped JSON answer naming a
  tool that was not offered is a call too, with ``tool_call_unknown_tool`` (the client reports the
  unknown tool to the model), except when the request asked for an output format.
* A start marker quoted in prose or code is text: one right after a backtick or inside a
  plain code block, or one whose next characters cannot begin a call of its family
  (``Markup.plausible``).
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

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from omlx.api.tool_call_formats import (
    Markup,
    as_list,
    canonical_family,
    markups_for,
    pythonic_calls,
    salvage_calls,
)
from omlx.api.tool_calls import (
    Delta,
    OutputWarning,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    call_arguments,
    calls_from_json,
    json_values,
    new_call_id,
    normalize_tools,
    strict_call,
)

__all__ = ["OutputParser", "ParsedOutput", "parse_output"]


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
_CALL_NAME = re.compile(r"^[\w.:\-]{1,128}$")
_ANY_NAME = re.compile(r"^[^\x00-\x1f]{1,128}$")  # a name in a call beyond doubt: one line, any characters
_FINISHED = ("}", "]", ")", ">", "｜>")  # how a call's text ends once it is complete
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
        unknown_tool_calls: bool = True,
    ):
        self.family = canonical_family(family)
        self._tools = normalize_tools(tools) or None
        self._names = {t["function"]["name"] for t in self._tools or []}
        self._fallbacks = bool(self._tools)
        self._unknown_calls = unknown_tool_calls
        self._markups = markups_for(self.family) if self._tools else []
        self._reasoning = bool(reasoning and think_start and think_end)
        self._think_start, self._think_end = think_start, think_end

        # text-mode triggers: (marker, kind, markup)
        triggers: list[tuple[str, str, Markup | None]] = [
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
        self._markup: Markup | None = None
        self._acc_reset()
        self._head = ""
        self._depth = 0
        self._quote = ""
        self._escape = False
        self._plaus: bool | None = None
        self._fence_body = -1
        self._fence_lang = ""
        self._tool_calls: list[ToolCall] = []
        self._warnings: list[OutputWarning] = []
        self._region_plausible: bool | None = None
        self._last_char = ""  # the last character read as text (a backtick quotes a marker)
        self._finished = False

    # ---------------------------------------------------------------- public

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self._tool_calls)

    @property
    def warnings(self) -> list[OutputWarning]:
        """What could not be read as the model meant it (see the module notes)."""
        return list(self._warnings)

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
                self._warn_if_call(self._acc_text(), "a JSON tool call")
                self._release_candidate()
            elif self._mode == _FENCED and not self._close_fence():
                self._warn_if_call(self._acc_text(), "a fenced tool call")
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
        if text:
            self._last_char = text[-1]

    def _warn(self, code: str, message: str) -> None:
        self._warnings.append(OutputWarning(code, message))

    def _warn_if_call(self, text: str, what: str) -> None:
        """An unfinished candidate that names an offered tool was a call cut off."""
        if salvage_calls(text.lstrip("`").removeprefix("json").removeprefix("tool_call"), self._names):
            self._warn("tool_call_unclosed", f"The output ended inside {what}; it is returned as text.")

    def _warn_problems(self, calls: list[ToolCall] | None) -> None:
        for call in calls or []:
            if call.problem:
                self._warn("tool_arguments_invalid", f"Tool call '{call.name}': {call.problem}.")

    def _unknown_tool_calls(self, text: str) -> list[ToolCall] | None:
        """A call-shaped JSON answer naming a tool that was not offered: a call all the same.

        Strictly call-shaped only - every item an object of ``name`` (one line, any characters:
        small models write "Read greet.py") plus ``arguments`` or ``parameters`` (an object or a
        JSON string) and at most ``id``/``type`` besides - and never under a requested output
        format. Returned as a call, the client tells the model the tool does not exist and the
        agent loop goes on; as text, it would end the turn as the answer. ``tool_call_unknown_tool``
        names it."""
        if not self._unknown_calls:
            return None
        try:
            values = json_values(text)
        except ValueError:
            return None
        items = [v for value in values for v in (value if isinstance(value, list) else [value])]
        parsed = [strict_call(v) for v in items]
        if not parsed or None in parsed:
            return None
        calls = self._make_calls(parsed, names=_ANY_NAME)
        unknown = [c.name for c in calls or [] if c.name not in self._names]
        if not calls or not unknown:
            return None
        self._warn("tool_call_unknown_tool", f"The model called '{unknown[0][:64]}', which is not among the "
                   "offered tools; it is returned as a tool call for the client to report.")  # fmt: skip
        self._warn_problems(calls)
        return calls

    def _make_calls(self, parsed: Any, known: set[str] | None = None, names: re.Pattern = _CALL_NAME) -> list[ToolCall] | None:
        if parsed is None:
            return None
        calls = []
        for call in as_list(parsed):
            if not isinstance(call, dict):
                return None
            name, args = call.get("name"), call.get("arguments")
            if not isinstance(name, str) or not names.match(name.strip()):
                return None  # a parser read something else as the name
            if name == "unknown" and isinstance(args, dict) and set(args) == {"raw"}:
                return None  # mlx-lm's glm47 parser gave up
            if known is not None and name.strip() not in known:
                return None
            model_id = call.get("id") if isinstance(call.get("id"), str) else None
            text, problem = call_arguments(args)
            calls.append(ToolCall(new_call_id(), name.strip(), text, model_id, problem))
        return calls or None

    def _salvaged(self, text: str) -> list[ToolCall] | None:
        """Calls no parser could read, with their arguments as generated (see the module notes)."""
        calls = self._make_calls(salvage_calls(text, self._names), known=self._names)
        self._warn_problems(calls)
        return calls

    # ---------------------------------------------------------------- text

    def _find_trigger(self, buf: str) -> tuple[int, tuple[str, str, Markup | None] | None]:
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
            self._emit_text_verbatim(buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        marker, kind, markup = trig
        self._text.emit(buf[:at])
        if at:
            self._last_char = buf[at - 1]
        if kind == "markup" and (self._in_code_fence or self._last_char == "`"):
            self._emit_text_verbatim(marker)  # quoted in code: text
            self._buf = buf[at + len(marker) :]
            return True
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
            self._region_plausible = None
            self._acc_reset()
        elif kind == "fence":
            if self._in_code_fence:  # closes a plain code block
                self._emit_text_verbatim(marker)
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
        if self._region_plausible is None and markup.plausible is not None:
            head = self._acc_text()[:_HEAD]
            verdict = markup.plausible(head)
            if verdict is False:
                self._release_marker()
                return True
            if verdict is None and len(head) >= _HEAD:
                verdict = True
            self._region_plausible = verdict
        if not markup.end:
            return False
        at = self._acc_find_new(markup.end, before, tail, new)
        if at < 0:
            return False
        region = self._acc_text()
        self._close_region(region[:at], closed=True)
        self._buf = region[at + len(markup.end) :] + self._buf
        return True

    def _release_marker(self) -> None:
        """A start marker quoted in prose: the marker is text, and so is what follows it."""
        markup = self._markup
        assert markup is not None
        self._emit_text_verbatim(self._held_ws + markup.start)
        self._held_ws = ""
        self._buf = self._acc_text() + self._buf
        self._acc_reset()
        self._mode, self._markup = _TEXT, None

    def _close_region(self, inner: str, closed: bool) -> None:
        markup = self._markup
        assert markup is not None
        try:
            calls = self._make_calls(markup.parse(inner, self._tools))
        except Exception:  # mlx-lm parsers raise assorted errors on malformed text
            calls = None
        self._warn_problems(calls)
        complete = closed or not markup.end  # end-less markup runs to the end of the output
        if calls and not complete and not inner.rstrip().endswith(_FINISHED):
            calls = None  # cut inside a value: what the lenient parsers read of it is not the call
        if not calls and complete:
            calls = self._salvaged(inner)
        self._mode, self._markup = _TEXT, None
        self._acc_reset()
        if calls:
            self._emit_calls(calls)
            return
        if self._region_plausible is False or not (inner.strip() or closed):
            pass  # a bare marker at the very end: nothing was meant
        elif complete:
            self._warn("tool_call_unparsed", f"A {markup.start} tool call could not be read; it is returned as text.")
        else:
            self._warn("tool_call_unclosed", f"The output ended inside a {markup.start} tool call "
                       f"(no {markup.end}) that does not parse; it is returned as text.")  # fmt: skip
        self._emit_text_verbatim(self._held_ws + markup.start + inner + (markup.end if closed else ""))
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
                calls = self._salvaged(text)
            if not calls:
                calls = self._unknown_tool_calls(text)
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
        for value in json_values(text):
            got = calls_from_json(value, self._names)
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

    def _close_fence(self) -> bool:
        """At the end: a call fence whose closing backticks are missing or cut short is closed when
        its body is a complete call (as an unclosed envelope is); whether it was."""
        if self._fence_body < 0:
            return False
        body = self._acc_text()[self._fence_body :].rstrip().rstrip("`").rstrip()
        calls = self._fence_calls(body) if body.endswith(_FINISHED) else None
        if not calls:
            return False
        self._mode = _TEXT
        self._acc_reset()
        self._emit_calls(calls)
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
                parsed = pythonic_calls(stripped, self._tools)
            else:
                parsed = self._json_calls(stripped)
            calls = self._make_calls(parsed, known=self._names)
        except Exception:  # mlx-lm's pythonic parser raises assorted errors
            calls = self._salvaged(stripped) if stripped[:1] == "{" else None
        if not calls and stripped[:1] in ("{", "["):
            calls = self._unknown_tool_calls(stripped)
        return calls

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
    warnings: list[OutputWarning]


def parse_output(text: str, **kwargs: Any) -> ParsedOutput:
    """Parse a complete output at once (same rules and arguments as :class:`OutputParser`)."""
    parser = OutputParser(**kwargs)
    deltas = parser.feed(text) + parser.finish()
    return ParsedOutput(
        text="".join(d.text for d in deltas if isinstance(d, TextDelta)),
        reasoning="".join(d.text for d in deltas if isinstance(d, ReasoningDelta)),
        tool_calls=parser.tool_calls,
        warnings=parser.warnings,
    )
