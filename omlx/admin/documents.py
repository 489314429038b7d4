"""Documents attached in the dashboard's chat, turned into text on the server.

`POST /api/chat/convert?name=FILE` with the file's bytes as the body answers
`{"name", "format", "chars", "text"}`. Plain text, Markdown, CSV and JSON are decoded as
UTF-8; PDF, DOCX, XLSX and HTML go through markitdown (the `omlx[documents]` extra), in a
thread. Limits and every refusal are in docs/chat.md.
"""

from __future__ import annotations

import asyncio
import io
import logging
from pathlib import PurePath
from typing import Any

from fastapi import APIRouter, Depends, Request

from omlx.errors import InvalidRequestError, OMLXError
from omlx.server.auth import require_admin

log = logging.getLogger("omlx.admin")

MAX_DOCUMENT_BYTES = 10 << 20  # one file as uploaded
MAX_DOCUMENT_CHARS = 200_000  # its text: about 50k tokens, more than most chat models hold
TEXT_FORMATS = {".txt": "text", ".md": "markdown", ".markdown": "markdown", ".csv": "csv", ".json": "json"}
CONVERTED_FORMATS = {".pdf": "pdf", ".docx": "docx", ".xlsx": "xlsx", ".html": "html", ".htm": "html"}

router = APIRouter(prefix="/api", dependencies=[Depends(require_admin)])


class DocumentTooLarge(OMLXError):
    status = 413
    error_type = "invalid_request_error"


class ConverterMissing(OMLXError):
    """markitdown is not installed: the server cannot read this format (501)."""

    status = 501
    error_type = "server_error"


def _decode(data: bytes, name: str) -> str:
    if b"\0" in data[:8192]:
        raise InvalidRequestError(f"{name} is not a text file (it holds binary data).", param="file")
    return data.decode("utf-8", errors="replace")


def _markitdown(data: bytes, ext: str, name: str) -> str:
    """The document's text as markdown, by the converter of its type alone (no fallback that
    would pass a broken PDF off as its raw bytes); a worker thread."""
    try:
        from markitdown import StreamInfo
        from markitdown import converters as mc
    except ImportError:
        raise ConverterMissing(
            f"Reading {ext} files needs markitdown on the server: pip install 'omlx[documents]'.", code="converter_missing"
        ) from None
    kind = {"pdf": mc.PdfConverter, "docx": mc.DocxConverter, "xlsx": mc.XlsxConverter, "html": mc.HtmlConverter}
    converter = kind[CONVERTED_FORMATS[ext]]()
    try:
        result = converter.convert(io.BytesIO(data), StreamInfo(extension=ext, filename=name))
    except ImportError as exc:  # a format's own optional dependency
        raise ConverterMissing(f"Reading {ext} files needs {exc.name or 'a package'} on the server: "
                               "pip install 'omlx[documents]'.", code="converter_missing") from None
    except Exception as exc:  # each format's parser raises its own kinds: all mean "unreadable"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise InvalidRequestError(f"Could not read {name} as {ext[1:].upper()}: {first}", param="file") from None
    return result.text_content or ""


def convert(data: bytes, name: str) -> dict[str, Any]:
    """`data` (a file called `name`) as text; InvalidRequestError / 413 / 501 for what cannot be read."""
    ext = PurePath(name).suffix.lower()
    fmt = TEXT_FORMATS.get(ext) or CONVERTED_FORMATS.get(ext)
    if fmt is None:
        known = ", ".join(sorted({*TEXT_FORMATS, *CONVERTED_FORMATS}))
        raise InvalidRequestError(f"Cannot read {name}: {ext or 'no extension'} is not a known document type ({known}).",
                                  param="name")
    if len(data) > MAX_DOCUMENT_BYTES:
        raise DocumentTooLarge(f"{name} is {len(data):,} bytes; a document may have at most {MAX_DOCUMENT_BYTES:,}.",
                               param="file", code="document_too_large")
    if not data:
        raise InvalidRequestError(f"{name} is empty.", param="file")
    text = _decode(data, name) if ext in TEXT_FORMATS else _markitdown(data, ext, name)
    if not text.strip():
        raise InvalidRequestError(f"{name} has no text to read (a scanned PDF needs OCR: send its pages as images).",
                                  param="file")
    if len(text) > MAX_DOCUMENT_CHARS:
        raise DocumentTooLarge(f"{name} holds {len(text):,} characters of text; a document may have at most "
                               f"{MAX_DOCUMENT_CHARS:,}.", param="file", code="document_too_large")
    return {"name": name, "format": fmt, "chars": len(text), "text": text}


@router.post("/chat/convert")
async def convert_document(request: Request, name: str = "") -> dict[str, Any]:
    """The uploaded body (the file's bytes) as text, for the chat to send with a message."""
    if not name or len(name) > 255:
        raise InvalidRequestError("Send the file's name as ?name= (1 to 255 characters).", param="name")
    data = await request.body()
    result = await asyncio.to_thread(convert, data, name)
    log.info("converted %s (%s, %d bytes) to %d characters", name, result["format"], len(data), result["chars"])
    return result
