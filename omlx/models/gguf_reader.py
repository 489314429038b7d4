"""Reading GGUF files (llama.cpp's format): header checks and metadata, and the error every
GGUF import step raises."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["GGUFImportError", "need", "open_reader", "read_gguf_metadata"]

_GGUF_MAGIC = b"GGUF"


class GGUFImportError(ValueError):
    """A GGUF file cannot be imported; the message says why and what to do."""


# --------------------------------------------------------------------------- reading


def _check_header(path: Path) -> int:
    """Check that *path* looks like a GGUF file; return its size."""
    if not path.exists():
        raise GGUFImportError(f"GGUF file not found: {path}. Check the path and try again.")
    if not path.is_file():
        raise GGUFImportError(f"{path} is not a file; pass the path of a .gguf file.")
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
    if size == 0:
        raise GGUFImportError(
            f"{path} is empty (0 bytes): the download or copy did not complete. "
            "Download the GGUF file again."
        )
    if head[:4] != _GGUF_MAGIC:
        if head[:4] in (b"lmgg", b"fmgg", b"tjgg", b"ggml", b"ggmf", b"ggjt"):
            raise GGUFImportError(
                f"{path} is an old GGML-format model (pre-GGUF). Convert it to GGUF with "
                "llama.cpp's conversion tools, or download a .gguf build of the model."
            )
        raise GGUFImportError(
            f"{path} is not a GGUF file (it does not start with the 'GGUF' magic bytes; "
            f"found {head[:4]!r}). Pass a .gguf model file; for a Hugging Face/MLX model "
            "folder (config.json + *.safetensors) load the folder directly instead."
        )
    if size < 24:
        raise GGUFImportError(
            f"{path} is truncated ({size} bytes, shorter than a GGUF header). "
            "Download the GGUF file again."
        )
    return size


def open_reader(path: Path):
    import gguf

    size = _check_header(path)
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as exc:  # the reader raises ValueError/IndexError/KeyError/...
        raise GGUFImportError(
            f"{path} is truncated or corrupt: it starts like a GGUF file but cannot be parsed "
            f"({size} bytes on disk; reader error: {type(exc).__name__}: {exc}). Download it "
            "again and check its size or checksum against the source."
        ) from exc
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise GGUFImportError(
            f"{path} is truncated: its tensors need {end} bytes but the file has {size}. "
            "The download or copy did not complete; download the GGUF file again."
        )
    return reader


def _field_value(field) -> Any:
    from gguf import GGUFValueType

    if not field.types:
        return None
    value = field.contents()
    if field.types[0] == GGUFValueType.ARRAY:
        return list(value)
    return value


def read_gguf_metadata(reader) -> dict[str, Any]:
    """All key/value metadata of an open ``gguf.GGUFReader`` as plain Python values."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = _field_value(field)
        except Exception as exc:
            raise GGUFImportError(
                f"metadata key {key!r} could not be decoded ({exc}); the file is corrupt. "
                "Download the GGUF file again."
            ) from exc
    return meta


def need(meta: dict[str, Any], key: str) -> Any:
    if key not in meta or meta[key] is None:
        raise GGUFImportError(
            f"GGUF metadata lacks {key!r}, which is needed to build the model config; "
            "the file is incomplete or was written by an unusual converter. Re-convert the "
            "model with a current llama.cpp."
        )
    return meta[key]
