"""Pointwise reranking with any chat model: P("yes") against P("no") as the next token.

The prompt follows Qwen3-Reranker's: a system message that asks for a yes/no judgement,
and a user message with the instruction, the query and one document, rendered with the
model's own chat template. The relevance score is softmax([logit_no, logit_yes])[1],
where each side sums (log-sum-exp) the single-token spellings of its word the tokenizer
has ("yes", "Yes", " yes" …): for Qwen3-Reranker that is exactly its "yes"/"no" pair, and
a general chat model that prefers "Yes" is still read correctly.

`prompt_ids` runs anywhere (tokenization); `score_prompts` makes MLX calls and must run
on the LLM engine's thread (`await engine.call(...)`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from omlx.api.chat_template import render_chat

SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".'
)
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
YES = ("yes", "Yes", "YES", " yes", " Yes", " YES")
NO = ("no", "No", "NO", " no", " No", " NO")
LOGIT_BUDGET_BYTES = 256 * 1024 * 1024  # full-vocabulary logits of one micro-batch


def prompt_ids(
    tokenizer: Any, query: str, document: str, instruction: str | None = None
) -> list[int]:
    messages = [
        {"role": "system", "content": SYSTEM},
        {
            "role": "user",
            "content": f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}",
        },
    ]
    # enable_thinking=False makes Qwen3-style templates open the answer with an empty
    # think block, as Qwen3-Reranker expects; other templates ignore the variable.
    return render_chat(tokenizer, messages, template_kwargs={"enable_thinking": False})


def answer_token_ids(tokenizer: Any) -> tuple[list[int], list[int]]:
    """Token ids of the single-token spellings of "yes" and of "no"."""

    def ids(words: tuple[str, ...]) -> list[int]:
        out: list[int] = []
        for w in words:
            enc = list(tokenizer.encode(w, add_special_tokens=False))
            if len(enc) == 1 and enc[0] not in out:
                out.append(enc[0])
        return out

    yes, no = ids(YES), ids(NO)
    if not yes or not no:
        raise ValueError("the tokenizer has no single-token 'yes' or 'no'")
    return yes, no


def micro_batches(lengths: list[int], vocab_size: int) -> list[list[int]]:
    """Indices by length, grouped so one batch's logits stay under the budget."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths[i] * vocab_size * 4 > LOGIT_BUDGET_BYTES:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def score_prompts(
    model: Any, prompts: list[list[int]], yes: list[int], no: list[int]
) -> list[float]:
    """Relevance in 0..1 for each prompt, from one right-padded forward pass.

    Right padding is harmless under a causal mask: a real token never attends to the
    padding after it, and we read each row's logits at its last real token.
    """
    longest = max(len(p) for p in prompts)
    x = mx.array([p + [0] * (longest - len(p)) for p in prompts], dtype=mx.int32)
    last = mx.array([len(p) - 1 for p in prompts], dtype=mx.int32)
    logits = model(x)
    rows = mx.take_along_axis(logits, last[:, None, None], axis=1)[:, 0].astype(mx.float32)
    lp = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    yes_lp = mx.logsumexp(lp[:, mx.array(yes)], axis=-1)
    no_lp = mx.logsumexp(lp[:, mx.array(no)], axis=-1)
    score = mx.softmax(mx.stack([no_lp, yes_lp], axis=-1), axis=-1)[:, 1]
    return score.tolist()
