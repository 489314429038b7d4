"""The server-side MCP tool loop a chat request opts in to with `"mcp"` (docs/agents.md).

`"mcp": true` offers every ready MCP tool; `"mcp": {"tools": [names or server names],
"max_rounds": n}` a subset and fewer rounds (at most `--mcp-max-rounds`). The MCP tools join the
request's own tools (a request tool of the same name wins). Each round generates; when no call
of the answer is to a request tool, the calls run (each within `--mcp-tool-timeout`, in
parallel; a call of a tool nobody offered gets an error result), the answer and the results
join the conversation, and the next round generates with `tool_choice` "auto". The loop ends with an answer without calls, one that calls a request
tool (returned to the client as it is), or at the round limit (returned as it is, with a
warning). A tool's error, timeout or failed server becomes the tool's result text, which the
model reads; it never fails the request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from omlx.api.chat_template import normalize_tool_calls
from omlx.api.tool_calls import OutputWarning, ReasoningDelta, TextDelta, ToolCall
from omlx.engine.llm_engine import LLMEngine
from omlx.engine.request import GenerationEvent
from omlx.errors import InvalidRequestError, OMLXError
from omlx.mcp.manager import McpManager, McpTool
from omlx.pool.engine_pool import Resolved
from omlx.server.chat_chunks import ChoiceState
from omlx.server.chat_pipeline import (
    ChatFinal,
    ChatResult,
    ChatTurn,
    final_from,
    parsed_events,
    prepare_chat,
)
from omlx.server.turn_memory import TurnMemory


@dataclass
class LoopOptions:
    names: set[str] | None  # tool or server names; None = all
    max_rounds: int
    tools: list[McpTool] = field(default_factory=list)  # offered to this request (`offered`)


@dataclass
class LoopResult:
    result: ChatResult  # the last round's
    rounds: list[dict[str, int]]  # per round: prompt, cached and completion tokens
    messages: list[dict[str, Any]]  # what the loop added, as OpenAI chat messages
    warnings: list[OutputWarning] = field(default_factory=list)
    request_id: str = ""  # the last round's


def loop_options(value: Any, max_rounds: int) -> LoopOptions | None:
    """The request's `mcp` field, checked (400 naming it), or None when it asks for no loop."""
    if value is None or value is False:
        return None
    if value is True:
        return LoopOptions(None, max_rounds)
    if not isinstance(value, dict):
        raise InvalidRequestError("mcp must be true or an object {\"tools\": [...], \"max_rounds\": n}.", param="mcp")
    names = value.get("tools")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise InvalidRequestError("mcp.tools must be a list of MCP tool or server names.", param="mcp.tools")
    rounds = value.get("max_rounds", max_rounds)
    if isinstance(rounds, bool) or not isinstance(rounds, int) or not 1 <= rounds <= max_rounds:
        raise InvalidRequestError(f"mcp.max_rounds must be an integer from 1 to {max_rounds}.", param="mcp.max_rounds")
    return LoopOptions(set(names) if names is not None else None, rounds)


def offered(manager: McpManager | None, options: LoopOptions, request_tools: list[dict[str, Any]] | None) -> list[McpTool]:
    """The MCP tools this request's model is offered."""
    taken = {t["name"] for t in request_tools or []}
    tools = manager.tools() if manager else []
    if options.names is not None:
        tools = [t for t in tools if t.name in options.names or t.server in options.names]
    return [t for t in tools if t.name not in taken]


async def _run_call(manager: McpManager, call: ToolCall) -> str:
    """A call's result as the model reads it; failures are described, never raised."""
    if call.problem:
        return f"Error: the arguments are not a JSON object ({call.problem}); nothing was run."
    try:
        result = await manager.call(call.name, json.loads(call.arguments or "{}"))
    except OMLXError as exc:
        return f"Error: {exc.message}"
    text = result.text()
    return f"Error: {text}" if result.is_error and not text.lower().startswith("error") else text


def for_the_client(calls: list[ToolCall], loop_names: set[str], tools: list[dict[str, Any]] | None) -> bool:
    """Whether an answer's calls go back to the client: one of them names a tool of the request
    itself. A call of a tool nobody offered runs in the loop, where it fails as "no MCP tool
    named …" and the model reads that, as it would from an agent."""
    own = {t["name"] for t in tools or []} - loop_names
    return any(c.name in own for c in calls)


@dataclass
class Started:
    """A round's request is prepared: its prompt's length."""

    prompt_tokens: int


@dataclass
class Step:
    """One engine event of the current round and the parsed deltas it produced."""

    deltas: list[Any]
    event: GenerationEvent


@dataclass
class Ran:
    """A round's MCP calls ran: its answer and their results, as OpenAI chat messages."""

    messages: list[dict[str, Any]]


async def tool_loop(
    engine: LLMEngine, resolved: Resolved, turn: ChatTurn, manager: McpManager | None, options: LoopOptions,
    default_max_tokens: int, memory: TurnMemory | None,
) -> AsyncIterator[Started | Step | Ran | LoopResult]:
    """Generate, run the MCP calls, feed the results back, until an answer needs none of them:
    per round `Started`, every engine event (`Step`) and, when its calls ran, `Ran`; then the
    `LoopResult`.
    `turn.tools` already holds `options.tools`."""
    names = {t.name for t in options.tools}
    rounds: list[dict[str, int]] = []
    added: list[dict[str, Any]] = []
    warnings: list[OutputWarning] = []
    for k in range(options.max_rounds):
        prepared = await prepare_chat(engine, resolved, turn, default_max_tokens, memory)
        engine.reserve([prepared.request])
        parser = prepared.new_parser()
        deltas: list[Any] = []
        events: list[GenerationEvent] = []
        final = None
        try:
            yield Started(len(prepared.request.prompt_tokens))
            async for batch, ev in parsed_events(engine.generate(prepared.request), parser, prepared):
                events.append(ev)
                deltas += batch
                if ev.finish_reason is not None:
                    final = final_from(ev, parser, prepared)
                yield Step(batch, ev)
        finally:
            engine.release([prepared.request])
        assert final is not None
        result = ChatResult(deltas, final, events)
        rounds.append({"prompt_tokens": final.prompt_tokens, "cached_tokens": final.cached_tokens,
                       "completion_tokens": final.completion_tokens})  # fmt: skip
        calls = [d for d in deltas if isinstance(d, ToolCall)]
        if not calls or manager is None or for_the_client(calls, names, turn.tools):
            break
        if k == options.max_rounds - 1:
            warnings.append(OutputWarning(
                "mcp_max_rounds", f"The MCP tool loop stopped after {options.max_rounds} rounds; the last answer's "
                "calls were not run.",
            ))  # fmt: skip
            break
        outputs = await asyncio.gather(*(_run_call(manager, c) for c in calls))
        state = ChoiceState()
        state.text = [d.text for d in deltas if isinstance(d, TextDelta)]
        state.reasoning = [d.text for d in deltas if isinstance(d, ReasoningDelta)]
        state.calls = calls
        message = state.message()
        results = [{"role": "tool", "tool_call_id": c.id, "name": c.name, "content": out}
                   for c, out in zip(calls, outputs, strict=True)]  # fmt: skip
        added += [message, *results]
        yield Ran([message, *results])
        internal = {"role": "assistant", "content": message["content"] or "",
                    "tool_calls": normalize_tool_calls(message["tool_calls"], "mcp")}  # fmt: skip
        if message.get("reasoning_content"):
            internal["reasoning_content"] = message["reasoning_content"]
        turn.messages = [*turn.messages, internal, *results]
        if turn.tool_choice not in (None, "none", "auto"):
            turn.tool_choice = "auto"  # a forced choice holds the first round only
    yield LoopResult(result, rounds, added, warnings, prepared.request.request_id)


def summed(result: LoopResult) -> ChatFinal:
    """The last round's finish with every round's tokens added up and the loop's warnings."""
    return replace(
        result.result.final,
        prompt_tokens=sum(r["prompt_tokens"] for r in result.rounds),
        cached_tokens=sum(r["cached_tokens"] for r in result.rounds),
        completion_tokens=sum(r["completion_tokens"] for r in result.rounds),
        warnings=[*result.result.final.warnings, *result.warnings],
    )


async def run_tool_loop(
    engine: LLMEngine, resolved: Resolved, turn: ChatTurn, manager: McpManager | None, options: LoopOptions,
    default_max_tokens: int, memory: TurnMemory | None,
) -> LoopResult:
    """`tool_loop` run to its end."""
    return await run_tool_loop_from(tool_loop(engine, resolved, turn, manager, options, default_max_tokens, memory))


async def run_tool_loop_from(steps: AsyncIterator[Started | Step | Ran | LoopResult]) -> LoopResult:
    """The `LoopResult` at the end of `steps`."""
    async for item in steps:
        if isinstance(item, LoopResult):
            return item
    raise AssertionError("the tool loop ended without a result")


async def primed(steps: AsyncIterator[Started | Step | Ran | LoopResult]) -> AsyncIterator[Started | Step | Ran | LoopResult]:
    """`steps` with its first round prepared now: a prompt too long or a full queue is the
    response's status (400, 429), not an error inside a stream already started."""
    first = await anext(steps)

    async def rest() -> AsyncIterator[Started | Step | Ran | LoopResult]:
        yield first
        async for item in steps:
            yield item

    return rest()
