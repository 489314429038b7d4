"""Images in requests, for every API: where each came from (`ImageRef`), fetched when remote and
allowed, checked and decoded with Pillow within limits. A bad, truncated, oversized (bytes or
pixels) or unsupported image is an `InvalidRequestError` naming the field; the pixel count is read
from the header before anything is decoded, so a decompression bomb never allocates its pixels.
Nothing here calls MLX; decoding runs off the event loop (`decode_all` in a thread).
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from dataclasses import dataclass
from typing import Any

from omlx.errors import InvalidRequestError

# where an image stands in a message's text until the chat template places it
IMAGE_MARK = "\x00omlx-image\x00"
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
MEDIA_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/gif", "image/webp", "image/bmp"}
MAX_IMAGES = 32  # per request


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 << 20
    max_pixels: int = 32 << 20
    allow_remote: bool = False
    remote_timeout: float = 10.0

    @classmethod
    def of(cls, settings: Any) -> ImageLimits:
        return cls(settings.max_image_bytes, settings.max_image_pixels, settings.allow_remote_images,
                   settings.remote_image_timeout)  # fmt: skip


@dataclass
class ImageRef:
    """One image of a request: its bytes, or a remote `url` still to fetch; `where` is its field."""

    where: str
    data: bytes | None = None
    url: str | None = None


def _bad(where: str, problem: str) -> InvalidRequestError:
    return InvalidRequestError(f"{where}: {problem}", param=where)


def from_base64(data: Any, media_type: Any, where: str, limits: ImageLimits) -> ImageRef:
    """A base64 image (Anthropic's source, a data URL's payload)."""
    if media_type is not None and str(media_type).lower() not in MEDIA_TYPES:
        raise _bad(where, f"unsupported image media type {str(media_type)[:40]!r}; send PNG, JPEG, GIF, WebP or BMP.")
    if not isinstance(data, str) or not data:
        raise _bad(where, "the image data must be a non-empty base64 string.")
    if len(data) * 3 // 4 > limits.max_bytes:
        raise _bad(where, f"the image is larger than {limits.max_bytes} bytes (--max-image-bytes).")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(where, "the image data is not valid base64.") from None
    return ImageRef(where, data=raw)


def from_url(url: Any, where: str, limits: ImageLimits) -> ImageRef:
    """An image URL (OpenAI `image_url`, Responses `input_image`): a data: URL, or http(s) when allowed."""
    if not isinstance(url, str) or not url:
        raise _bad(where, "the image URL must be a non-empty string.")
    if url.startswith("data:"):
        head, sep, payload = url[5:].partition(",")
        if not sep or ";base64" not in head:
            raise _bad(where, "a data: URL must be base64, as data:image/png;base64,<data>.")
        return from_base64(payload, head.split(";")[0] or None, where, limits)
    if url.startswith(("http://", "https://")):
        if not limits.allow_remote:
            raise _bad(where, "remote image URLs are not fetched by this server (--allow-remote-images is off); "
                              "send the image as a data: URL.")  # fmt: skip
        return ImageRef(where, url=url)
    raise _bad(where, f"unsupported image URL scheme in {url[:40]!r}; send a data: URL.")


async def fetch_remote(refs: list[ImageRef], limits: ImageLimits) -> None:
    """Fetch the remote ones in place, each within the byte limit and the timeout."""
    import httpx

    remote = [r for r in refs if r.data is None]
    if not remote:
        return
    async with httpx.AsyncClient(timeout=limits.remote_timeout, follow_redirects=True, max_redirects=3) as client:
        for ref in remote:
            try:
                async with client.stream("GET", ref.url) as resp:
                    if resp.status_code != 200:
                        raise _bad(ref.where, f"fetching the image URL gave HTTP {resp.status_code}.")
                    chunks, size = [], 0
                    async for chunk in resp.aiter_bytes():
                        size += len(chunk)
                        if size > limits.max_bytes:
                            raise _bad(ref.where, f"the image is larger than {limits.max_bytes} bytes (--max-image-bytes).")
                        chunks.append(chunk)
                    ref.data = b"".join(chunks)
            except httpx.HTTPError as exc:
                raise _bad(ref.where, f"the image URL could not be fetched: {type(exc).__name__}.") from None


def decode(ref: ImageRef, limits: ImageLimits) -> Any:
    """The image as an RGB Pillow image (its first frame), or a 400 saying what is wrong with it."""
    from PIL import Image, UnidentifiedImageError

    data = ref.data or b""
    if len(data) > limits.max_bytes:
        raise _bad(ref.where, f"the image is larger than {limits.max_bytes} bytes (--max-image-bytes).")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data), formats=FORMATS)  # reads the header only
            w, h = img.size
            if w * h > limits.max_pixels:
                raise _bad(ref.where, f"the image has {w}x{h} pixels, more than {limits.max_pixels} (--max-image-pixels).")
            if w < 1 or h < 1:
                raise _bad(ref.where, "the image has no pixels.")
            img.load()  # a truncated or corrupt image fails here
            return img.convert("RGB")
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise _bad(ref.where, f"the image has more than {limits.max_pixels} pixels (--max-image-pixels).") from None
        except UnidentifiedImageError:
            raise _bad(ref.where, "the data is not an image this server reads (PNG, JPEG, GIF, WebP, BMP).") from None
        except (OSError, ValueError, SyntaxError) as exc:  # Pillow's errors for truncated and corrupt data
            raise _bad(ref.where, f"the image is truncated or corrupt ({exc}).") from None


def decode_all(refs: list[ImageRef], limits: ImageLimits) -> list[Any]:
    """Every image decoded (CPU-heavy: call in a thread)."""
    if len(refs) > MAX_IMAGES:
        raise _bad(refs[MAX_IMAGES].where, f"at most {MAX_IMAGES} images per request.")
    return [decode(r, limits) for r in refs]
