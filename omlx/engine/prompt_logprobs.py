"""Log-probabilities of the prompt's own tokens, as evaluation harnesses ask via `echo`,
and of each generated token with its top alternatives (`token_logprob`).

Runs on the engine thread with a private cache, chunked so long prompts do not
materialise a full (tokens x vocab) matrix at once.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from omlx.engine.request import TokenLogprob, finite_logprob

CHUNK = 512


def compute_prompt_logprobs(model: Any, tokens: list[int], top: int) -> list[TokenLogprob | None]:
    """Entry i holds log P(tokens[i] | tokens[:i]); the first token has none."""
    cache = make_prompt_cache(model)
    out: list[TokenLogprob | None] = [None]
    prev_last: mx.array | None = None
    for start in range(0, len(tokens), CHUNK):
        chunk = tokens[start : start + CHUNK]
        logits = model(mx.array(chunk)[None], cache=cache)[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        rows = logprobs if prev_last is None else mx.concatenate([prev_last[None], logprobs[:-1]])
        targets = chunk if prev_last is not None else chunk[1:]
        if prev_last is None:
            rows = logprobs[:-1]
        prev_last = logprobs[-1]
        if not targets:
            continue
        target_arr = mx.array(targets)
        chosen = mx.take_along_axis(rows, target_arr[:, None], axis=-1)[:, 0]
        if top > 0:
            idx = mx.argsort(-rows, axis=-1)[:, :top]
            vals = mx.take_along_axis(rows, idx, axis=-1)
            mx.eval(chosen, idx, vals)
            idx_l, vals_l = idx.tolist(), vals.tolist()
        else:
            mx.eval(chosen)
            idx_l = vals_l = [[] for _ in targets]
        for j, (tok, lp) in enumerate(zip(targets, chosen.tolist(), strict=True)):
            top_j = [(t, finite_logprob(v)) for t, v in zip(idx_l[j], vals_l[j], strict=True)]
            out.append(TokenLogprob(tok, finite_logprob(float(lp)), top_j))
    return out


def token_logprob(logprobs: mx.array, token: int, top: int) -> TokenLogprob:
    """The chosen token's logprob and the `top` alternatives."""
    chosen = logprobs[token].item()
    alternatives: list[tuple[int, float]] = []
    if top > 0:
        top = min(top, logprobs.shape[-1])
        idx = mx.argpartition(-logprobs, kth=top - 1)[:top]
        vals = logprobs[idx]
        order = mx.argsort(-vals)
        alternatives = [(t, finite_logprob(v)) for t, v in zip(idx[order].tolist(), vals[order].tolist(), strict=True)]
    return TokenLogprob(token, finite_logprob(float(chosen)), alternatives)
