"""A token bitmask applied to next-token logits: the allowed tokens keep their logits, the
others get -inf. One int32 word holds 32 tokens (llguidance's layout). Engine thread only."""

from __future__ import annotations

import functools
import threading

import mlx.core as mx
import numpy as np


def mask_words(vocab_size: int) -> int:
    """How many int32 words a mask over `vocab_size` tokens takes."""
    return (vocab_size + 31) // 32


def _masked(logits: mx.array, words: mx.array, word: mx.array, bit: mx.array) -> mx.array:
    allowed = (mx.take(words, word, axis=-1) >> bit) & 1
    return mx.where(allowed.astype(mx.bool_), logits, mx.array(-mx.inf, dtype=logits.dtype))


class TokenMask:
    """Applies a (rows, `mask_words(vocab)`) int32 bitmask to (rows, vocab) logits."""

    def __init__(self, vocab_size: int) -> None:
        ids = mx.arange(vocab_size, dtype=mx.int32)
        self.word = ids // 32
        self.bit = ids % 32
        self._apply = mx.compile(_masked)

    def __call__(self, logits: mx.array, words: np.ndarray) -> mx.array:
        return self._apply(logits, mx.array(words), self.word, self.bit)


@functools.lru_cache(maxsize=16)
def _token_mask(vocab_size: int, thread: int) -> TokenMask:
    return TokenMask(vocab_size)


def token_mask(vocab_size: int) -> TokenMask:
    """The calling engine thread's mask for logits of `vocab_size` (its arrays live there)."""
    return _token_mask(vocab_size, threading.get_ident())
