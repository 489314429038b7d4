"""DeepSeek-OCR (mlx-vlm's `deepseekocr`) as the engine's text model: the second adapter beside
`VisionLM`'s M-RoPE one. Its language model is a DeepSeek-V2 with plain RoPE, so a token's position
is its cache offset (no positions to pass, rope delta 0: `RopeKVCache` rows of 0, and rows with and
without images decode in one step as for the other VLMs). A vision prompt's embeddings are the
token embeddings with each image's slots filled by mlx-vlm's own `get_input_embeddings` (SAM + CLIP
over the global view and the tiles, projected, with the newline and view-separator slots), called
once per image on that image's span of the prompt (docs/design/vision.md). All calls on the
engine's thread.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from omlx.engine.vision_input import OcrInput
from omlx.engine.vision_lm import VisionLM

# mlx-vlm 0.7.10 builds the SAM encoder at this size whatever the config says (`SAMViTConfig()`)
SAM_HEADS, SAM_WIDTH, SAM_PATCH = 12, 768, 16
GLOBAL_VIEW, TILE = 1024, 640  # the processor's base_size and image_size (pixels)


def activation_bytes(crops: list[tuple[int, int]]) -> int:
    """An estimate of the vision tower's peak for these images' (tiles across, down) grids: SAM's
    float32 global-attention scores over all patches of one pass (the global view, or all of an
    image's tiles at once) plus a few hidden states."""

    def one(batch: int, side: int) -> int:
        patches = (side // SAM_PATCH) ** 2
        return 4 * batch * (SAM_HEADS * patches * patches + 8 * patches * SAM_WIDTH)

    tiles = max((w * h for w, h in crops if w * h > 1), default=0)
    return max(one(1, GLOBAL_VIEW), one(tiles, TILE) if tiles else 0)


class OcrLM(VisionLM):
    """The language half of an mlx-vlm DeepSeek-OCR, called as an mlx-lm model."""

    def __init__(self, vlm: nn.Module, model_type: str) -> None:
        nn.Module.__init__(self)
        self.vlm = vlm
        self.model_type = model_type
        self.vocab_size = vlm.config.text_config.vocab_size
        self.image_token_id = int(vlm.config.image_token_index)

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None, embeds: mx.array | None = None, **_: Any) -> mx.array:
        """Logits for `inputs` (B, L); `embeds` (B, L, D) replace the token embeddings (a vision
        prompt's chunk); positions are each row's cache offset (plain RoPE)."""
        lm = self.vlm.language_model
        inputs = mx.where(inputs >= self.vocab_size, self.image_token_id, inputs)  # keyed image ids
        return lm.lm_head(lm.model(inputs, inputs_embeds=embeds, cache=cache))

    def prefill(self, tokens: list[int], vision: Any, cached: int) -> OcrPrefill:
        return OcrPrefill(self, tokens, vision, cached)


class OcrPrefill:
    """A DeepSeek-OCR vision prompt's chunks after `cached` tokens: token embeddings with each
    image's features in its slots (the towers run only for images not wholly inside the cached
    prefix); `delta` is 0 (plain RoPE)."""

    delta = 0

    def __init__(self, model: OcrLM, tokens: list[int], vision: OcrInput, cached: int) -> None:
        vlm = model.vlm
        ids = mx.array(tokens)[None]
        ids = mx.where(ids >= model.vocab_size, model.image_token_id, ids)
        self.start = cached
        embeds = vlm.language_model.model.embed_tokens(ids[:, cached:])
        for i, (start, length) in enumerate(vision.spans):
            if start + length <= cached:
                continue  # inside the restored prefix: its keys and values are cached already
            tiles, view, (w, h) = vision.views[i]
            features = vlm.get_input_embeddings(
                ids[:, start : start + length], pixel_values=[tiles if tiles is not None else view, view],
                images_spatial_crop=mx.array([[w, h]]), images_seq_mask=np.ones((1, length), dtype=bool),
            ).inputs_embeds[0]  # fmt: skip
            skip = max(0, cached - start)  # its first tokens are cached
            at = start + skip - cached
            embeds[:, at : at + length - skip] = features[skip:].astype(embeds.dtype)[None]
        self.embeds = embeds
        mx.eval(self.embeds)

    def chunk(self, start: int, n: int) -> dict[str, mx.array]:
        """The model's extra arguments for prompt tokens [start, start + n)."""
        a = start - self.start
        return {"embeds": self.embeds[:, a : a + n]}
