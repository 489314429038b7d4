"""The SSD tier's file format: one safetensors file per block, its `__metadata__` naming the
block (key, parent, fingerprint, token count, layer types, checksum); reading and checking
a file is bytes and hashing only (no MLX), safe on any thread."""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import TensorSpec, serialize

from omlx.cache.block import HostBlock, HostTensors, checksum_host, checksum_matches

# "2": a block's tensors may be all layers stacked as one (`kv_layout.KV_STACK`); builds
# that know only "1" (a tensor per layer) discard such files rather than serve them wrong.
# "3": a block of a model with stateful layers (`layer_states`: per-leaf kinds in
# `layer_types`, whole states at the block's end); plain-KV blocks are still written as "2".
FORMAT_VERSION = "2"
STATEFUL_FORMAT_VERSION = "3"
READABLE_FORMATS = ("1", "2", "3")
SUFFIX = ".safetensors"
TMP_MARK = ".safetensors.tmp-"
_MAX_HEADER = 64 << 20  # no sane block header is anywhere near this


class CorruptBlockFile(Exception):
    """A block file that must not be served (truncated, unparsable, mismatching)."""


_KEY = re.compile(r"[0-9a-f]{64}")


def is_key(text: str) -> bool:
    """A block key (64 lowercase hex digits). Asked on every presence check, up to 255 times
    in a lookup's tail search: a regex, not a check char by char."""
    return _KEY.fullmatch(text) is not None


def read_header(path: Path | str, file_size: int | None = None) -> dict[str, str]:
    """The `__metadata__` of a block file, read from its header only, after checking the file is
    exactly as long as the header says; raises `CorruptBlockFile` (`FileNotFoundError` passes)."""
    with open(path, "rb") as f:
        if file_size is None:
            file_size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = header_length(head, file_size)
        raw = f.read(n)
    return parse_header(raw, n, file_size)[0]


def header_length(head: bytes, file_size: int) -> int:
    if len(head) != 8:
        raise CorruptBlockFile("shorter than the safetensors length prefix")
    (n,) = struct.unpack("<Q", head)
    if n == 0 or n > _MAX_HEADER or 8 + n > file_size:
        raise CorruptBlockFile(f"bad header length {n} for a {file_size}-byte file")
    return n


def parse_header(raw: bytes, n: int, file_size: int) -> tuple[dict[str, str], dict[str, Any]]:
    """(metadata, tensor entries) of a block file's JSON header, validated against its size."""
    if len(raw) != n:
        raise CorruptBlockFile("truncated header")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptBlockFile(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptBlockFile("header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict):
        raise CorruptBlockFile("no __metadata__ in header")
    end = 0
    for name, info in header.items():
        try:
            start, stop = info["data_offsets"]
            start, stop = int(start), int(stop)
        except (KeyError, TypeError, ValueError):
            raise CorruptBlockFile(f"bad data_offsets for {name!r}") from None
        if not 0 <= start <= stop:
            raise CorruptBlockFile(f"bad data_offsets for {name!r}")
        end = max(end, stop)
    if 8 + n + end != file_size:
        raise CorruptBlockFile(f"size {file_size} != {8 + n + end} announced by the header")
    if meta.get("format_version") not in READABLE_FORMATS:
        raise CorruptBlockFile(f"unknown format_version {meta.get('format_version')!r}")
    for field in ("key", "fingerprint", "checksum", "token_count", "layer_types"):
        if not isinstance(meta.get(field), str):
            raise CorruptBlockFile(f"metadata field {field!r} missing")
    return meta, header


# safetensors dtype codes of the tensors a block can hold, as MLX dtype names
_ST_DTYPES = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64",
    "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
    "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool",
}  # fmt: skip


def check_identity(meta: Mapping[str, str], key: str, fingerprint: str) -> None:
    if meta.get("key") != key:
        raise CorruptBlockFile("metadata key does not match the file's key")
    if meta.get("fingerprint") != fingerprint:
        raise CorruptBlockFile("block belongs to another model fingerprint")


def block_metadata(block: HostBlock) -> dict[str, str]:
    """The `__metadata__` a block's file is written with."""
    return {
        "format_version": FORMAT_VERSION if all(t == "kv" for t in block.layer_types) else STATEFUL_FORMAT_VERSION,
        "key": block.key,
        "parent": block.parent or "",
        "token_count": str(int(block.token_count)),
        "fingerprint": block.fingerprint,
        "layer_types": json.dumps(list(block.layer_types)),
        "checksum": checksum_host(block.host),
    }


def load_block(path: Path, key: str, fingerprint: str) -> tuple[HostBlock, int]:
    """Read a whole block file into memory and verify it: bytes and hashing only."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = header_length(f.read(8), size)
        meta, entries = parse_header(f.read(n), n, size)  # rejects truncated files early
        check_identity(meta, key, fingerprint)
        data = f.read()
    if len(data) != size - 8 - n:
        raise CorruptBlockFile("file changed while reading")
    buf = np.frombuffer(data, dtype=np.uint8)
    host: HostTensors = {}
    for name, info in entries.items():
        dt = _ST_DTYPES.get(info.get("dtype"))
        shape = info.get("shape")
        if dt is None or not isinstance(shape, list):
            raise CorruptBlockFile(f"bad dtype or shape for {name!r}")
        start, stop = (int(x) for x in info["data_offsets"])
        tensor = buf[start:stop]
        if tensor.nbytes != int(np.prod(shape, dtype=np.int64)) * np.dtype(
            "uint16" if dt == "bfloat16" else dt
        ).itemsize:
            raise CorruptBlockFile(f"size of {name!r} does not match its shape")
        host[name] = (dt, tuple(int(d) for d in shape), tensor)
    if not checksum_matches(host, meta["checksum"]):
        raise CorruptBlockFile("checksum mismatch")
    try:
        token_count = int(meta["token_count"])
        layer_types = json.loads(meta["layer_types"])
    except (ValueError, json.JSONDecodeError) as exc:
        raise CorruptBlockFile(f"bad metadata: {exc}") from None
    if not isinstance(layer_types, list):
        raise CorruptBlockFile("layer_types is not a list")
    read = HostBlock(
        key=key,
        parent=meta.get("parent") or None,
        fingerprint=fingerprint,
        token_count=token_count,
        layer_types=[str(t) for t in layer_types],
        host=host,
    )
    return read, size


def serialized(host: HostTensors, metadata: dict[str, str]) -> bytes:
    """A block file's bytes: its tensors and `metadata` in safetensors form."""
    specs = {
        name: TensorSpec(dtype=dt, shape=list(shape), data_ptr=data.ctypes.data, data_len=data.nbytes)
        for name, (dt, shape, data) in host.items()
    }  # `host` keeps the buffers alive for the call
    return serialize(specs, metadata)
