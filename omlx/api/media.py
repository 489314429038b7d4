"""What a text model does with the images and documents agents send: one policy for every API.

Until a vision model serves them: media at the top level of a message is a 400 naming the
model (the answer would silently ignore what the user showed); media inside a tool result (a
screenshot tool, a PDF reader) becomes a text placeholder the model sees, and the response
carries a warning. Content of types this server does not know is dropped with a log note.
"""

from __future__ import annotations

import logging

from omlx.api.tool_calls import OutputWarning
from omlx.errors import InvalidRequestError

log = logging.getLogger("omlx.api")

IMAGE_KINDS = frozenset({"image", "image_url", "input_image"})
DOCUMENT_KINDS = frozenset({"document", "file", "input_file"})


class MediaPolicy:
    """Collects the warnings of one request's conversion; `model` is the name the caller asked for."""

    def __init__(self, model: str):
        self.model = model
        self.warnings: list[OutputWarning] = []

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
