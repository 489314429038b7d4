"""A DeepSeek-OCR prompt: the messages formatted as mlx-vlm formats them for this model (each image
an `<image>\\n` before its message's text, through the processor's chat template: DeepSeek's
"plain" format, no role tags), tokenized by mlx-vlm's own `DeepseekOCRProcessor` with the images
(BOS; per image a run of slots: the global view's 16 rows of 16, the tiles' rows when the image is
larger than 640 pixels, each row with a newline slot, and the view separator; the template's
trailing space dropped), and each
image's slots replaced by keyed ids of the image's digest, as for the other VLMs
(`vision_prompt.keyed_ids`), so the prefix cache keys them by image content.

The processor makes MLX arrays (the normalized views), so it runs on the engine's thread
(`LLMEngine.call`, between steps); decoding stays in a worker thread (docs/design/vision.md).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from omlx.api.images import ImageLimits, ImageRef, decode_all, fetch_remote
from omlx.engine.vision_input import OcrInput
from omlx.errors import InvalidRequestError
from omlx.server.vision_prompt import keyed_ids, with_image_parts

IMAGE = "<image>"


def ocr_text(processor: Any, messages: list[dict[str, Any]], images: int) -> str:
    """The prompt text mlx-vlm's `apply_chat_template` makes of these messages (image marks as image
    parts); a 400 when a message's image was not placed or its text holds `<image>` itself."""
    from mlx_vlm.prompt_utils import apply_chat_template

    if any(IMAGE in str(m.get("content") or "") for m in messages):
        raise InvalidRequestError(f"the text must not contain '{IMAGE}', this model's image placeholder.", param="messages")
    shown = [{"role": m["role"], "content": m.get("content") or ""} for m in with_image_parts(messages)]
    text = apply_chat_template(processor, {"model_type": "deepseekocr"}, shown, num_images=images)
    if text.count(IMAGE) != images:
        raise InvalidRequestError(
            f"the model's prompt format placed {text.count(IMAGE)} of the {images} images sent (it shows images in "
            "user messages only); move the images into user messages.",
            param="messages",
        )
    return text


def _runs(mask: list[bool]) -> list[tuple[int, int]]:
    """(start, length) of each run of True."""
    out: list[tuple[int, int]] = []
    for i, m in enumerate(mask):
        if m and (not out or out[-1][0] + out[-1][1] != i):
            out.append((i, 0))
        if m:
            out[-1] = (out[-1][0], out[-1][1] + 1)
    return out


def tokenize(processor: Any, text: str, images: list[Any]) -> tuple[list[int], list[tuple[int, int]], list[Any]]:
    """(tokens, each image's span, each image's (tiles, global view, (across, down))) as mlx-vlm's
    processor makes them; MLX arrays: call on the engine's thread. Without images, the processor's
    rule for text: BOS, the text's tokens, the last (the template's trailing space) dropped."""
    import mlx.core as mx

    if not images:
        ids = processor.tokenizer.encode(text, add_special_tokens=False)
        return [0, *ids][:-1] if ids else [0], [], []  # the processor's BOS is id 0
    out = processor.process_one(prompt=text, images=images)
    tokens = [int(t) for t in out["input_ids"][0].tolist()]
    spans = _runs([bool(m) for m in out["images_seq_mask"][0].tolist()])
    if len(spans) != len(images):
        raise InvalidRequestError("each image must be separated from the next by text.", param="messages")
    all_tiles, views = out["images"]
    views_out, at = [], 0
    for i, (w, h) in enumerate(out["images_spatial_crop"].tolist()):
        w, h = int(w), int(h)
        tiles = all_tiles[at : at + w * h] if w * h > 1 else None
        at += w * h if w * h > 1 else 0
        views_out.append((tiles, views[i : i + 1], (w, h)))
    mx.eval([v for view in views_out for v in view[:2] if v is not None])
    return tokens, spans, views_out


async def ocr_prompt(
    engine: Any, parts: Any, messages: list[dict[str, Any]], refs: list[ImageRef], limits: ImageLimits
) -> tuple[list[int], OcrInput | None]:
    """The prompt tokens of `messages` for DeepSeek-OCR, its images' slots keyed by their digests,
    and the images as the engine's prefill takes them (None without images)."""
    from omlx.engine.vision_ocr import activation_bytes

    await fetch_remote(refs, limits)
    images = await asyncio.to_thread(decode_all, refs, limits)
    text = ocr_text(parts.ocr, messages, len(images))
    tokens, spans, views = await engine.call(lambda: tokenize(parts.ocr, text, images))
    if not images:
        return tokens, None
    keys = {}
    for ref, (start, n) in zip(refs, spans, strict=True):
        keys[start] = hashlib.sha256(ref.data or b"").digest()
        tokens[start : start + n] = keyed_ids(keys[start], n)
    if spans[-1][0] + spans[-1][1] >= len(tokens):
        raise InvalidRequestError("the prompt must not end with an image.", param="messages")
    return tokens, OcrInput(views, spans, activation_bytes([v[2] for v in views]), keys)
