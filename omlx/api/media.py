"""What a model does with the images and documents agents send: one policy for every API.

A vision model (`vision`) gets each image, at the top level or inside a tool result: the part is
checked and kept (`images`), and `IMAGE_MARK` stands in the text where the template will place it.
A text model, and any model for documents: media at the top level of a message is a 400 naming
the model (the answer would silently ignore what the user showed); media inside a tool result (a
screenshot tool, a PDF reader) becomes a text placeholder the model sees, and the response
carries a warning. Content of types this server does not know is dropped with a log note.
"""

from __future__ import annotations

import logging
from typing import Any

from omlx.api.images import IMAGE_MARK, ImageLimits, ImageRef, from_base64, from_url
from omlx.api.tool_calls import OutputWarning
from omlx.errors import InvalidRequestError

log = logging.getLogger("omlx.api")

IMAGE_KINDS = frozenset({"image", "image_url", "input_image"})
DOCUMENT_KINDS = frozenset({"document", "file", "input_file"})


class MediaPolicy:
    """Collects the warnings of one request's conversion; `model` is the name the caller asked for."""

    def __init__(self, model: str, vision: bool = False, limits: ImageLimits | None = None):
        self.model = model
        self.vision = vision
        self.limits = limits or ImageLimits()
        self.warnings: list[OutputWarning] = []
        self.images: list[ImageRef] = []  # a vision model's images, in the order of their marks

    def image(self, kind: str, part: dict[str, Any], param: str, in_tool_result: bool) -> str:
        """The text that stands for an image part: `IMAGE_MARK` for a vision model (the image
        checked and kept), else a placeholder inside a tool result, else a 400."""
        if not self.vision:
            if not in_tool_result:
                raise self.refuse(kind, param)
            return self.placeholder(kind, param)
        self.images.append(self._ref(kind, part, param))
        return IMAGE_MARK

    def _ref(self, kind: str, part: dict[str, Any], param: str) -> ImageRef:
        if kind == "image":  # Anthropic: {"source": {"type": "base64", "media_type", "data"} | {"type": "url", "url"}}
            source = part.get("source")
            if not isinstance(source, dict):
                raise InvalidRequestError(f"{param}.source must be an object.", param=f"{param}.source")
            if source.get("type") == "base64":
                return from_base64(source.get("data"), source.get("media_type"), f"{param}.source.data", self.limits)
            if source.get("type") == "url":
                return from_url(source.get("url"), f"{param}.source.url", self.limits)
            raise InvalidRequestError(f"{param}.source.type must be 'base64' or 'url'.", param=f"{param}.source.type")
        url = part.get("image_url")  # OpenAI chat: {"url", "detail"} or a string; Responses: a string
        if isinstance(url, dict):
            return from_url(url.get("url"), f"{param}.image_url.url", self.limits)
        if url is None and part.get("file_id") is not None:
            raise InvalidRequestError(f"{param}.file_id: uploaded files are not supported; send the image as a data: URL.",
                                      param=f"{param}.file_id")  # fmt: skip
        return from_url(url, f"{param}.image_url", self.limits)

    def refuse(self, kind: str, param: str) -> InvalidRequestError:
        """Media at the top level of a message."""
        what = "images" if kind in IMAGE_KINDS else "documents of this kind"
        return InvalidRequestError(
            f"{param}: model '{self.model}' is a text model and cannot read {what} ('{kind}' content); "
            "send text, or use a vision model.",
            param=param,
        )

    def placeholder(self, kind: str, param: str) -> str:
        """Media inside a tool result: the text the model sees instead, and a warning."""
        what = "an image" if kind in IMAGE_KINDS else "a document"
        self.warnings.append(OutputWarning(
            "media_omitted",
            f"{param}: {what} in a tool result was replaced by a placeholder; model '{self.model}' cannot read it.",
        ))  # fmt: skip
        return f"[{what} was here; this model cannot see it]"

    def drop(self, kind: object, param: str) -> None:
        """Content of a type this server does not know: left out, with a note in the log."""
        log.info("dropping %s content of unknown type %r (model %s)", param, str(kind)[:40], self.model)
