"""A Qwen2-VL-family model (mlx-vlm) as the engine's text model: `VisionLM` is called like an
mlx-lm model (`model(tokens, cache=...)`) by the `BatchGenerator`, the solo sequence and the
prefill chunks; a vision prompt's chunks also pass `embeds` and `positions` (`VisionPrefill`).

M-RoPE: after an image, a text token's rotary position is its index plus the prompt's rope
delta (negative: an image's tokens take fewer positions than tokens). Each sequence's delta
rides in its own cache (`RopeKVCache`), and in a batch as one row each (`RopeBatchKVCache`), so
rows with and without images decode in one step (docs/design/vision.md). The model's own cache
(`make_prompt_cache`) stays plain `KVCache`, which the prefix cache stores and restores; the runner
wraps a cache carrying a delta around it where one is needed (`with_delta`, vision_admit.py). All
calls on the engine's thread.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache

from omlx.engine.vision_input import VisionInput


class RopeKVCache(KVCache):
    """A sequence's `KVCache` and its rope delta (0 for a text-only prompt)."""

    def __init__(self, rope_delta: int = 0) -> None:
        super().__init__()
        self.rope_delta = rope_delta

    def merge(self, caches: list[Any]) -> RopeBatchKVCache:  # type: ignore[override]
        return RopeBatchKVCache.merge(caches)


class RopeBatchKVCache(BatchKVCache):
    """mlx-lm's `BatchKVCache` with a rope delta per row, kept through filter, extend and extract."""

    def __init__(self, left_padding: list[int]) -> None:
        super().__init__(left_padding)
        self.rope_deltas = mx.zeros((len(left_padding),), dtype=mx.int32)

    @classmethod
    def merge(cls, caches: list[Any]) -> RopeBatchKVCache:
        batch = super().merge(caches)
        if not isinstance(batch, RopeBatchKVCache):  # mlx-lm made a plain one for empty caches
            plain, batch = batch, cls([0] * len(caches))
            batch.left_padding, batch.offset = plain.left_padding, plain.offset
        batch.rope_deltas = mx.array([getattr(c, "rope_delta", 0) for c in caches], dtype=mx.int32)
        return batch

    def filter(self, batch_indices: Any) -> None:
        super().filter(batch_indices)
        self.rope_deltas = self.rope_deltas[batch_indices]

    def extend(self, other: Any) -> None:
        other_deltas = getattr(other, "rope_deltas", mx.zeros((other.offset.shape[0],), dtype=mx.int32))
        super().extend(other)
        self.rope_deltas = mx.concatenate([self.rope_deltas, other_deltas])

    def extract(self, idx: int) -> RopeKVCache:
        plain = super().extract(idx)
        cache = RopeKVCache(int(self.rope_deltas[idx].item()))
        cache.keys, cache.values, cache.offset = plain.keys, plain.values, plain.offset
        return cache


def with_delta(cache: list[Any] | None, delta: int) -> list[Any] | None:
    """`cache` (a restored prefix: plain `KVCache`s) as `RopeKVCache`s carrying `delta`; the arrays are shared."""
    if cache is None:
        return None
    out = []
    for c in cache:
        r = RopeKVCache(delta)
        r.keys, r.values, r.offset = c.keys, c.values, c.offset
        out.append(r)
    return out


class VisionLM(nn.Module):
    """The language half of an mlx-vlm Qwen2-VL-family model, called as an mlx-lm model."""

    def __init__(self, vlm: nn.Module, model_type: str) -> None:
        super().__init__()
        self.vlm = vlm
        self.model_type = model_type
        self.vocab_size = vlm.config.text_config.vocab_size
        self.image_token_id = int(vlm.config.image_token_id)

    @property
    def layers(self) -> list[Any]:
        return self.vlm.language_model.model.layers

    def __call__(
        self, inputs: mx.array, cache: list[Any] | None = None, embeds: mx.array | None = None,
        positions: mx.array | None = None, **_: Any,
    ) -> mx.array:  # fmt: skip
        """Logits for `inputs` (B, L); `embeds` (B, L, D) replace the token embeddings (a vision
        prompt's chunk), `positions` (3, B, L) its M-RoPE positions; else each row's positions
        continue from its cache's offset plus its rope delta."""
        lm = self.vlm.language_model
        # an image's tokens carry its digest as ids past the vocabulary (vision.md, "Cache keys")
        inputs = mx.where(inputs >= self.vocab_size, self.image_token_id, inputs)
        if positions is None:
            positions = self._positions(inputs.shape[0], inputs.shape[1], cache)
        h = lm.model(inputs, inputs_embeds=embeds, cache=cache, position_ids=positions)
        if lm.args.tie_word_embeddings:
            return lm.model.embed_tokens.as_linear(h)
        return lm.lm_head(h)

    def prefill(self, tokens: list[int], vision: VisionInput, cached: int) -> VisionPrefill:
        """The prompt's chunks after `cached` tokens, image features in place (`VisionPrefill`)."""
        return VisionPrefill(self, tokens, vision, cached)

    @staticmethod
    def _positions(batch: int, length: int, cache: list[Any] | None) -> mx.array:
        steps = mx.arange(length, dtype=mx.int32)[None]
        c = cache[0] if cache else None
        if c is None:
            start = mx.zeros((batch, 1), dtype=mx.int32)
        elif isinstance(c.offset, mx.array):  # a batch: per-row offsets
            start = (c.offset.astype(mx.int32) + getattr(c, "rope_deltas", 0))[:, None]
        else:
            start = mx.full((batch, 1), c.offset + getattr(c, "rope_delta", 0), dtype=mx.int32)
        return mx.broadcast_to((start + steps)[None], (3, batch, length))


class VisionPrefill:
    """A vision prompt's chunks after `cached` tokens: embeddings with each image's features in
    place (the vision tower runs only for images not wholly inside the cached prefix) and M-RoPE
    positions; `delta` is the prompt's rope delta, which decoding adds to each position."""

    def __init__(self, model: VisionLM, tokens: list[int], vision: VisionInput, cached: int) -> None:
        vlm = model.vlm
        ids = mx.array(tokens)[None]
        ids = mx.where(ids >= model.vocab_size, model.image_token_id, ids)
        grid = mx.array(vision.grid_thw)
        positions, delta = vlm.language_model.get_rope_index(ids, grid)
        self.delta = int(mx.array(delta).reshape(-1)[0].item())
        self.start = cached
        self.positions = positions[:, :, cached:]
        embeds = vlm.language_model.model.embed_tokens(ids[:, cached:])
        dtype = vlm.vision_tower.patch_embed.proj.weight.dtype
        for i, (start, length) in enumerate(vision.spans):
            if start + length <= cached:
                continue  # inside the restored prefix: its keys and values are cached already
            lo, hi = vision.patches(i)
            pixels = mx.array(vision.pixel_values[lo:hi]).astype(dtype)
            features = vlm.vision_tower(pixels, grid[i : i + 1], output_hidden_states=False)
            if features.shape[0] != length:
                raise ValueError(f"image {i} gave {features.shape[0]} features for {length} tokens")
            skip = max(0, cached - start)  # its first tokens are cached
            at = start + skip - cached
            embeds[:, at : at + length - skip] = features[skip:].astype(embeds.dtype)[None]
        self.embeds = embeds
        mx.eval(self.embeds, self.positions)

    def chunk(self, start: int, n: int) -> dict[str, mx.array]:
        """The model's extra arguments for prompt tokens [start, start + n)."""
        a, b = start - self.start, start - self.start + n
        return {"embeds": self.embeds[:, a:b], "positions": self.positions[:, :, a:b]}
