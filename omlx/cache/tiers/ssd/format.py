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
from typing import Any, BinaryIO

import numpy as np

from omlx.cache.block.block import (
    HostBlock,
    HostTensors,
    checksum_host,
    checksum_matches,
    is_state_tensor,
)

# "2": a block's tensors may be all layers stacked as one (`kv_layout.KV_STACK`); builds
# that know only "1" (a tensor per layer) discard such files rather than serve them wrong.
# "3": a block of a model with stateful layers (`layer_states`: per-leaf kinds in
# `layer_types`, whole states at the block's end), one checksum over all its tensors.
# "4": the same tensors, `checksum` over its KV tensors and `state_checksum` over its state
# tensors, so either part is read and verified alone (docs/design/cache-kinds.md). Stateful
# blocks are written as "4"; plain-KV blocks are still written as "2".
FORMAT_VERSION = "2"
STATEFUL_FORMAT_VERSION = "4"
READABLE_FORMATS = ("1", "2", "3", "4")
# what a read takes of a block: all its tensors, its KV tensors alone, or its state tensors alone
ALL, KV_PART, STATE_PART = "all", "kv", "state"
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
    fields = ("key", "fingerprint", "checksum", "token_count", "layer_types")
    for field in (*fields, "state_checksum") if meta["format_version"] == "4" else fields:
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
    """The `__metadata__` a block's file is written with: a stateful block's (format 4) with a
    checksum of its KV tensors and one of its state tensors, a plain-KV block's as before."""
    meta = {
        "format_version": FORMAT_VERSION,
        "key": block.key,
        "parent": block.parent or "",
        "token_count": str(int(block.token_count)),
        "fingerprint": block.fingerprint,
        "layer_types": json.dumps(list(block.layer_types)),
    }
    if all(t == "kv" for t in block.layer_types):
        meta["checksum"] = checksum_host(block.host)
    else:
        meta["format_version"] = STATEFUL_FORMAT_VERSION
        meta["checksum"] = checksum_host(block.part(state=False).host)
        meta["state_checksum"] = checksum_host(block.part(state=True).host)
    return meta


def load_block(path: Path, key: str, fingerprint: str, part: str = ALL) -> tuple[HostBlock, int]:
    """Read a block file (`part`: all its tensors, or only its KV or its state tensors) and verify
    what was read: bytes and hashing only. A file older than format 4 is read and verified whole."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = header_length(f.read(8), size)
        meta, entries = parse_header(f.read(n), n, size)  # rejects truncated files early
        check_identity(meta, key, fingerprint)
        by_part = meta["format_version"] == "4"
        if part == ALL or not by_part:
            data = f.read()
            if len(data) != size - 8 - n:
                raise CorruptBlockFile("file changed while reading")
            buf = np.frombuffer(data, dtype=np.uint8)
            host = {name: _tensor(name, info, buf[_span(info)]) for name, info in entries.items()}
        else:
            wanted = {name: info for name, info in entries.items() if is_state_tensor(name) == (part == STATE_PART)}
            host = _read_parts(f, 8 + n, wanted)
    _verify(host, meta, by_part, part)
    if part != ALL:
        host = {name: t for name, t in host.items() if is_state_tensor(name) == (part == STATE_PART)}
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
        partial=part != ALL,
    )
    return read, size


def _verify(host: HostTensors, meta: Mapping[str, str], by_part: bool, part: str) -> None:
    """Check what was read against the file's checksums (format 4: of each part read)."""
    if not by_part:
        ok = checksum_matches(host, meta["checksum"])
    else:
        ok = all(
            checksum_matches({n: t for n, t in host.items() if is_state_tensor(n) == state}, meta[field])
            for state, field in ((False, "checksum"), (True, "state_checksum"))
            if part == ALL or (part == STATE_PART) == state
        )
    if not ok:
        raise CorruptBlockFile("checksum mismatch")


def _span(info: Mapping[str, Any]) -> slice:
    start, stop = (int(x) for x in info["data_offsets"])
    return slice(start, stop)


def _itemsize(dt: str) -> int:
    return np.dtype("uint16" if dt == "bfloat16" else dt).itemsize


def _tensor(name: str, info: Mapping[str, Any], data: np.ndarray) -> tuple[str, tuple[int, ...], np.ndarray]:
    """A tensor's host entry from its header `info` and bytes, checked against its shape."""
    dt = _ST_DTYPES.get(info.get("dtype"))
    shape = info.get("shape")
    if dt is None or not isinstance(shape, list):
        raise CorruptBlockFile(f"bad dtype or shape for {name!r}")
    if data.nbytes != int(np.prod(shape, dtype=np.int64)) * _itemsize(dt):
        raise CorruptBlockFile(f"size of {name!r} does not match its shape")
    return dt, tuple(int(d) for d in shape), data


def _read_parts(f: Any, base: int, entries: Mapping[str, Any]) -> HostTensors:
    """Only `entries`' bytes of an open block file whose data starts at `base`: each run of adjacent
    tensors read at once into one buffer, at its place modulo 8 (the dtypes' alignment kept)."""
    runs: list[list[Any]] = []  # [start, stop, names]
    for start, stop, name in sorted((_span(info).start, _span(info).stop, name) for name, info in entries.items()):
        if runs and runs[-1][1] == start:
            runs[-1][1] = stop
            runs[-1][2].append(name)
        else:
            runs.append([start, stop, [name]])
    buf = np.empty(sum(stop - start + 7 for start, stop, _ in runs), dtype=np.uint8)
    host: HostTensors = {}
    at = 0
    for start, stop, names in runs:
        at += (start - at) % 8
        f.seek(base + start)
        if f.readinto(memoryview(buf[at : at + stop - start])) != stop - start:
            raise CorruptBlockFile("file changed while reading")
        for name in names:
            span = _span(entries[name])
            host[name] = _tensor(name, entries[name], buf[at + span.start - start : at + span.stop - start])
        at += stop - start
    return host


_DTYPE_CODES = {name: code for code, name in _ST_DTYPES.items()}


def write_block(f: BinaryIO, host: HostTensors, metadata: dict[str, str]) -> None:
    """Write a block file to `f`: what `safetensors.serialize` would build (tensors by element
    size, then name), each tensor written from its own buffer so the GIL is let go during the
    write, never held for a whole block (docs/design/write-back.md)."""
    order = sorted(host, key=lambda n: (-_itemsize(host[n][0]), n))
    header: dict[str, Any] = {"__metadata__": metadata}
    at = 0
    for name in order:
        dt, shape, data = host[name]
        header[name] = {"dtype": _DTYPE_CODES[dt], "shape": list(shape), "data_offsets": [at, at + data.nbytes]}
        at += data.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    f.write(struct.pack("<Q", len(raw)) + raw)
    for name in order:
        data = host[name][2]
        f.write(memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8)))
