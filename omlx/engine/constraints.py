"""What a request's output is held to, token by token: a grammar on its answer (an llguidance
matcher), reasoning that ends before the answer starts, and a thinking budget after which the
model's end-of-reasoning marker is forced (docs/design/structured-output.md).

A `Constraint` is built once per request, before it reaches the engine (`omlx/engine/grammar.py`
compiles the grammar); each sequence gets its own `ConstraintState` (pure Python) inside a
`ConstraintProcessor`, the logits processor the engine thread calls before sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import mlx.core as mx
import numpy as np

from omlx.engine.token_mask import mask_words, token_mask


class ConstraintError(Exception):
    """The request's own grammar cannot go on (a dead end, or a limit of the grammar engine):
    the request fails alone, and its caller is told why."""

    error_type = "invalid_request_error"


@dataclass(frozen=True)
class Reasoning:
    """How the model reasons before it answers: `end` is its end-of-reasoning marker (token ids);
    `open`: the prompt left the output inside reasoning; `start`: the single token that opens
    reasoning (None: it takes several), which the output may begin with where not `open` and which
    a budget of 0 bans; `budget`: reasoning tokens before `end` is forced (None: no limit)."""

    end: tuple[int, ...]
    open: bool = True
    start: int | None = None
    budget: int | None = None


@dataclass(frozen=True)
class Constraint:
    """A request's constraint: `grammar` is a fresh llguidance `LLMatcher` (each sequence takes a
    copy; None: the answer is free), over a vocabulary of `vocab_size` with `eos_ids` ending it."""

    vocab_size: int
    eos_ids: tuple[int, ...]
    grammar: Any = None
    reasoning: Reasoning | None = None

    def processor(self, prompt_len: int) -> ConstraintProcessor:
        """A new sequence's processor (engine thread)."""
        matcher = self.grammar.deep_copy() if self.grammar is not None else None
        return ConstraintProcessor(ConstraintState(self, matcher), prompt_len, self.vocab_size)


class Phase(Enum):
    OPENING = "opening"  # the first token: the answer's, or the one opening reasoning
    REASONING = "reasoning"
    FORCING = "forcing"  # the end-of-reasoning marker, the budget being spent
    ANSWER = "answer"  # under the grammar
    FREE = "free"  # nothing left to hold


@dataclass(frozen=True)
class Rule:
    """The tokens allowed next: `ONLY` these tokens, all `BUT` these, or the grammar's (`GRAMMAR`)
    plus these."""

    kind: str
    tokens: tuple[int, ...] = ()

    ONLY = "only"
    BUT = "but"
    GRAMMAR = "grammar"


class ConstraintState:
    """One sequence's place in its constraint: fed the tokens it generates (`advance`), it says
    what may come next (`allowed`; None: anything)."""

    def __init__(self, constraint: Constraint, matcher: Any) -> None:
        self.constraint = constraint
        self.matcher = matcher
        self.reasoned = 0  # reasoning tokens so far
        self.recent: list[int] = []  # the last tokens of reasoning, to spot its end marker
        self.forced: tuple[int, ...] = ()  # what is left of the marker being forced
        reasoning = constraint.reasoning
        # a budget of 0 allows no reasoning at all: its opening token may never come (a model that
        # opened it anyway would get an empty block forced, or reason after its forced end)
        start = reasoning.start if reasoning is not None and reasoning.budget == 0 else None
        self.banned: tuple[int, ...] = (start,) if start is not None else ()
        if reasoning is not None and reasoning.open:
            self.phase = Phase.REASONING
        elif reasoning is not None and reasoning.start is not None:
            self.phase = Phase.OPENING
        else:
            self.phase = self._answer_phase()
        self._settle()

    @property
    def needs_tokens(self) -> bool:
        """Whether the tokens generated must be read to know what comes next."""
        return self.phase is not Phase.FREE

    def _answer_phase(self) -> Phase:
        return Phase.ANSWER if self.matcher is not None else Phase.FREE

    def advance(self, token: int) -> None:
        """`token` was generated."""
        reasoning = self.constraint.reasoning
        if self.phase is Phase.OPENING:
            if reasoning is not None and token == reasoning.start:
                self.phase = Phase.REASONING
                return
            self.phase = self._answer_phase()
        if self.phase is Phase.REASONING:
            assert reasoning is not None
            self.reasoned += 1
            self.recent = (self.recent + [token])[-len(reasoning.end) :]
            if tuple(self.recent) == reasoning.end:
                self.phase = self._answer_phase()
        elif self.phase is Phase.FORCING:
            self.forced = self.forced[1:]
            if not self.forced:
                self.phase = self._answer_phase()
        elif self.phase is Phase.ANSWER and not self.matcher.consume_token(token):
            raise ConstraintError(f"the grammar rejected token {token}: {first_line(self.matcher.get_error())}")
        self._settle()

    def _settle(self) -> None:
        """Start forcing the end-of-reasoning marker once the budget is spent."""
        reasoning = self.constraint.reasoning
        if self.phase is not Phase.REASONING or reasoning is None or reasoning.budget is None:
            return
        if self.reasoned >= reasoning.budget:
            end = reasoning.end
            done = next((k for k in range(len(end) - 1, 0, -1) if tuple(self.recent[-k:]) == end[:k]), 0)
            self.forced = end[done:]
            self.phase = Phase.FORCING

    def allowed(self) -> Rule | None:
        """What may come next; None: anything."""
        phase = self.phase
        if phase is Phase.FORCING:
            return Rule(Rule.ONLY, self.forced[:1])
        if phase is Phase.REASONING:
            # the answer must come: the output may not end inside reasoning
            return Rule(Rule.BUT, self.constraint.eos_ids) if self.matcher is not None else None
        banned = self.banned
        if phase is Phase.OPENING:
            start = self.constraint.reasoning.start  # type: ignore[union-attr]
            if self.matcher is None:
                return Rule(Rule.BUT, banned) if banned else None
            return Rule(Rule.GRAMMAR, () if banned else (start,))
        if phase is Phase.ANSWER:
            return Rule(Rule.GRAMMAR)
        return Rule(Rule.BUT, banned) if banned else None


def fill_words(words: np.ndarray, rule: Rule, matcher: Any) -> None:
    """Write `rule` into the (1, n) int32 bitmask `words`."""
    if rule.kind == Rule.BUT:
        words.fill(-1)
    else:
        words.fill(0)
    if rule.kind == Rule.GRAMMAR:
        if not matcher.is_error():
            _fill_next_token_bitmask()(matcher, words, 0)
        if matcher.is_error():
            raise ConstraintError(f"the grammar cannot go on: {first_line(matcher.get_error())}")
    flat = words.reshape(-1).view(np.uint32)
    for token in rule.tokens:
        word, bit = divmod(token, 32)
        if rule.kind == Rule.BUT:
            flat[word] &= ~np.uint32(1 << bit)
        else:
            flat[word] |= np.uint32(1 << bit)
    if rule.kind == Rule.GRAMMAR and not flat.any():
        raise ConstraintError("the grammar reached a dead end: no token may come next and it is not complete")


def first_line(message: str) -> str:
    """llguidance's message without the parser state it appends."""
    return message.strip().split("\n", 1)[0][:300]


def _fill_next_token_bitmask() -> Any:
    from llguidance.numpy import fill_next_token_bitmask

    return fill_next_token_bitmask


class ConstraintProcessor:
    """An mlx-lm logits processor `(tokens, logits) -> logits` for one sequence: it reads the
    tokens generated since its last call, then masks the logits as its state says. It launches
    nothing itself: work launched before the read would queue the read behind it (one stream),
    so the host would wait for this step's whole forward pass before it could fill a mask."""

    def __init__(self, state: ConstraintState, prompt_len: int, vocab_size: int) -> None:
        self.state = state
        self.prompt_len = prompt_len
        self.seen = 0  # generated tokens already fed to the state
        self.words = np.zeros((1, mask_words(vocab_size)), dtype=np.int32)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        try:
            return self._masked(tokens, logits)
        except BaseException as exc:  # a panic in llguidance's Rust is a BaseException: this request's alone
            if type(exc).__name__ != "PanicException":
                raise
            raise ConstraintError(f"the grammar engine failed: {first_line(str(exc))}") from None

    def _masked(self, tokens: mx.array, logits: mx.array) -> mx.array:
        new = tokens.shape[-1] - self.prompt_len - self.seen
        if new > 0:
            if self.state.needs_tokens:
                for token in tokens.reshape(-1)[-new:].tolist():
                    self.state.advance(token)
            self.seen += new
        rule = self.state.allowed()
        if rule is None:
            return logits
        fill_words(self.words, rule, self.state.matcher)
        return token_mask(logits.shape[-1])(logits, self.words)
