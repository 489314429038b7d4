"""A vision model's prompt: its images fetched, decoded and preprocessed off the event loop, placed
by the model's own chat template, and each image's one placeholder token expanded to the tokens
its features fill (`VisionInput` rides on the `GenerationRequest`).

Cache keys: an image's tokens in the prompt are ids past the vocabulary derived from the image's
SHA-256 (`keyed_ids`), so the prefix cache's chained block keys carry the image from the block
holding its first token on: same image and text hit, another image misses from there, and the
blocks before it stay shared with text-only prompts. The engine's model maps those ids back to
the image token (docs/design/vision.md, "Cache keys").
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from omlx.api.images import IMAGE_MARK, ImageLimits, ImageRef, decode_all, fetch_remote
from omlx.errors import InvalidRequestError

KEY_BASE = 1 << 30  # keyed ids lie in [2**30, 2**31): past any vocabulary, inside int32


def keyed_ids(digest: bytes, n: int) -> list[int]:
    """`n` ids for one image's tokens, each 30 bits of SHA-256 over the image's digest and its index."""
    out = []
    for j in range(n):
        h = hashlib.sha256(digest + j.to_bytes(4, "little")).digest()
        out.append(KEY_BASE | (int.from_bytes(h[:4], "little") & (KEY_BASE - 1)))
    return out


def with_images(messages: list[dict[str, Any]], images: list[ImageRef]) -> list[dict[str, Any]]:
    """Copies of `messages` where each one whose text holds image marks keeps its images (`_images`),
    for a conversation stored to be continued later (Responses' `previous_response_id`)."""
    out, k = [], 0
    for m in messages:
        content = m.get("content")
        n = content.count(IMAGE_MARK) if isinstance(content, str) else 0
        out.append({**m, "_images": images[k : k + n]} if n else m)
        k += n
    return out


def images_apart(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """`with_images` undone: the messages as the template sees them, and their images in order."""
    images: list[ImageRef] = []
    out = []
    for m in messages:
        if "_images" in m:
            images += m["_images"]
            m = {k: v for k, v in m.items() if k != "_images"}
        out.append(m)
    return out, images


def with_image_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages whose text holds image marks get content lists of text and image parts, as
    vision chat templates read them."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, str) and IMAGE_MARK in content:
            parts: list[dict[str, Any]] = []
            for k, piece in enumerate(content.split(IMAGE_MARK)):
                if k:
                    parts.append({"type": "image"})
                if piece:
                    parts.append({"type": "text", "text": piece})
            m = {**m, "content": parts}
        out.append(m)
    return out


async def load_images(refs: list[ImageRef], limits: ImageLimits, parts: Any) -> tuple[Any, Any, list[bytes]]:
    """(pixel_values, grid_thw, digests) of the request's images: remote ones fetched (when allowed),
    all decoded within the limits and run through the model's image processor, in a thread."""
    import numpy as np

    from omlx.models.vision import process_images

    await fetch_remote(refs, limits)
    images = await asyncio.to_thread(decode_all, refs, limits)
    digests = [hashlib.sha256(r.data or b"").digest() for r in refs]

    def each() -> tuple[Any, Any]:
        done = []
        for ref, image in zip(refs, images, strict=True):  # one at a time: a refusal names its image
            try:
                done.append(process_images(parts, [image]))
            except (ValueError, TypeError) as exc:  # the processor refuses shapes it cannot patch
                raise InvalidRequestError(f"{ref.where}: the image cannot be prepared for this model: {exc}",
                                          param=ref.where) from None  # fmt: skip
        return np.concatenate([p for p, _ in done]), np.concatenate([g for _, g in done])

    pixel_values, grid = await asyncio.to_thread(each)
    return pixel_values, grid, digests


def expand(prompt: list[int], parts: Any, grid: Any, digests: list[bytes]) -> tuple[list[int], list[tuple[int, int]]]:
    """The prompt with each image token expanded to its keyed ids, and each image's (start, length)."""
    found = [i for i, t in enumerate(prompt) if t == parts.image_token_id]
    if len(found) != len(digests):
        raise InvalidRequestError(
            f"the model's chat template placed {len(found)} of the {len(digests)} images sent (it cannot show images "
            "in every message role); move the images into user messages.",
            param="messages",
        )
    out: list[int] = []
    spans = []
    at = 0
    for i, pos in enumerate(found):
        out += prompt[at:pos]
        n = parts.tokens_for(grid[i])
        spans.append((len(out), n))
        out += keyed_ids(digests[i], n)
        at = pos + 1
    out += prompt[at:]
    if spans and spans[-1][0] + spans[-1][1] >= len(out):
        raise InvalidRequestError("the prompt must not end with an image.", param="messages")
    return out, spans


def check_sampling(sampling: Any) -> None:
    """Penalties read the prompt's token ids, which for images are keys, not tokens: refused with images."""
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(sampling, name, None)
        if value not in (None, 0.0, 1.0 if name == "repetition_penalty" else 0.0):
            raise InvalidRequestError(f"{name} is not supported with images yet.", param=name)
