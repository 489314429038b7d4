"""A request's `Constraint`, built once before it reaches the engine: its output format, the
tool calls its tool choice forces (or its strict tools hold), its reasoning and thinking budget.

Nothing asked for is left unenforced: what cannot be compiled is a 400 naming the field
(docs/design/structured-output.md).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from omlx.api.output_format import ANY_OBJECT, OutputFormat
from omlx.api.tool_call_grammars import calls_grammar, opener
from omlx.engine.constraints import Constraint, Reasoning
from omlx.engine.grammar import (
    compile_grammar,
    format_grammar,
    json_with_options,
    ll_tokenizer,
    llguidance,
    token_marker,
)
from omlx.engine.llm_engine import LLMEngine
from omlx.errors import InvalidRequestError

# OpenAI's reasoning efforts as thinking budgets (tokens); "none" ends reasoning at once
EFFORT_BUDGETS = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768}


def effort_budget(effort: Any, param: str) -> int | None:
    """A reasoning effort ("low", "medium" …) as a thinking budget; None when not given."""
    if effort is None:
        return None
    if effort not in EFFORT_BUDGETS:
        raise InvalidRequestError(f"{param} must be one of {', '.join(EFFORT_BUDGETS)}, got {str(effort)[:40]!r}.",
                                  param=param)
    return EFFORT_BUDGETS[effort]


@dataclass(frozen=True)
class ToolForcing:
    """The calls a tool choice forces or strict tools hold: `tools` ({"name", "parameters"}) in
    the model's syntax; `single`: exactly one call; `free_text`: a text answer is also allowed."""

    tools: list[dict[str, Any]]
    single: bool
    free_text: bool


def tool_forcing(tools: list[dict[str, Any]] | None, choice: str | None, has_format: bool) -> ToolForcing | None:
    """What `choice` asks of the tool calls: `required` (one call) or a tool's name (that tool,
    once) are enforced with each tool's schema; `auto` holds calls to strict tools to their
    schemas (others to any object), or lets calls sit beside a response format; else nothing."""
    if not tools or choice == "none":
        return None
    if choice == "required":  # one call: a small model asked for several repeats them to its budget
        return ToolForcing([_call_spec(t, True) for t in tools], single=True, free_text=False)
    if choice not in (None, "auto"):
        return ToolForcing([_call_spec(t, True) for t in tools if t["name"] == choice], single=True, free_text=False)
    if has_format or any(t.get("strict") for t in tools):
        return ToolForcing([_call_spec(t, bool(t.get("strict"))) for t in tools], single=False, free_text=not has_format)
    return None


def _call_spec(tool: dict[str, Any], enforce: bool) -> dict[str, Any]:
    return {"name": tool["name"], "parameters": tool["parameters"] if enforce else ANY_OBJECT}


def reasoning_for(tokenizer: Any, starts_in_reasoning: bool, budget: int | None, grammar: bool) -> Reasoning | None:
    """How the model's reasoning comes before a grammar, or under a thinking budget (None: it
    does not reason, or nothing needs to know)."""
    end = tuple(getattr(tokenizer, "think_end_tokens", None) or ())
    if not getattr(tokenizer, "has_thinking", False) or not end or (budget is None and not grammar):
        return None
    start = tuple(getattr(tokenizer, "think_start_tokens", None) or ())
    if starts_in_reasoning:
        return Reasoning(end, open=True, start=start[0] if len(start) == 1 else None, budget=budget)
    return Reasoning(end, open=False, start=start[0], budget=budget) if len(start) == 1 else None


def _family_info(tokenizer: Any) -> str:
    """The chat template text: families with variants are told apart by it."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return "\n".join(t for t in template.values() if isinstance(t, str))
    return template if isinstance(template, str) else ""


def _text_answer(marker: Any, start: str) -> str:
    """A text answer that cannot be mistaken for the start of a call (a Lark regex)."""
    if marker(start).startswith("<["):
        return "/(?s:.*)/"  # the call opens with a special token, which text never produces
    first = "\\" + start[0] if start[0] in "[]\\^-/" else start[0]
    return "/(?s:[^" + first + "].*)?/"


def _compile(
    engine: LLMEngine, fmt: OutputFormat | None, forcing: ToolForcing | None, family: str | None
) -> tuple[Any, str | None]:
    """(The compiled matcher or None, the family whose parser reads the calls); in a thread."""
    tokenizer = engine.tokenizer
    lltok = ll_tokenizer(tokenizer, engine.model_vocab_size, engine.eos_ids, engine.model_id)
    if forcing is None:
        assert fmt is not None
        return compile_grammar(lltok, format_grammar(fmt.kind, fmt.value, fmt.param), fmt.param), family
    marker = token_marker(lltok)
    info = _family_info(tokenizer)
    rules, family = calls_grammar(family, forcing.tools, marker, single=forcing.single, family_info=info)
    if fmt is not None:  # an answer in the format, or calls
        top = "start: answer | calls\nanswer: %json " + json.dumps(json_with_options(fmt.value), ensure_ascii=False)
        param = fmt.param
    elif forcing.free_text:
        top = "start: TEXT | calls\nTEXT: " + _text_answer(marker, opener(family or "hermes", info))
        param = "tools"
    else:
        top = "start: calls"
        param = "tool_choice"
    grammar = llguidance().LLMatcher.grammar_from_lark(top + "\n" + rules)
    return compile_grammar(lltok, grammar, param), family


async def build_constraint(
    engine: LLMEngine,
    *,
    fmt: OutputFormat | None = None,
    forcing: ToolForcing | None = None,
    family: str | None = None,
    starts_in_reasoning: bool = False,
    budget: int | None = None,
) -> tuple[Constraint | None, str | None]:
    """The request's constraint (None: nothing to hold) and the family its tool calls are read as."""
    matcher = None
    if fmt is not None or forcing is not None:
        matcher, family = await asyncio.to_thread(_compile, engine, fmt, forcing, family)
    reasoning = reasoning_for(engine.tokenizer, starts_in_reasoning, budget, matcher is not None)
    if matcher is None and reasoning is None:
        return None, family
    return Constraint(engine.model_vocab_size, tuple(engine.eos_ids), matcher, reasoning), family
