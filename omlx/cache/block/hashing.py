"""Stable identities for cache blocks: model fingerprints and chained block keys, SHA-256 over
explicit byte encodings (never the salted `hash()`); equal keys mean same model, same whole
prefix, so a block is only reused behind exactly the prefix it was computed for."""

from __future__ import annotations

import array
import hashlib
import json
import struct
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["model_fingerprint", "weights_digest", "block_keys", "ExtraKeys", "FINGERPRINT_VERSION"]

# token position -> bytes mixed into the key of the block holding it (an image's digest at its first token)
ExtraKeys = Mapping[int, bytes]

# Bump when the meaning of a block payload changes (slicing rules, what a tensor name
# means...): every fingerprint, hence every key, changes and old blocks can never be served.
# A new layout that readers tell apart by its tensors' names needs no bump (the stacked
# `kv` tensor: older files still load); the SSD tier's FORMAT_VERSION keeps older
# builds from reading it.
FINGERPRINT_VERSION = "omlx-block-v1"

_EDGE_BYTES = 1 << 20  # how much of each end of a weight file is hashed
_WEIGHT_SUFFIXES = (".safetensors", ".gguf")
_ROOT = b"root"
_UINT32 = array.array("I")  # C's unsigned int: 4 bytes on every platform MLX runs on
_NO_TOKEN = 0xFFFFFFFF  # marks an extra key in a block's message: no token id is this large


def model_fingerprint(
    model_path_identity: str,
    weights_digest: str,
    dtype: str,
    kv_format: str,
    block_size: int,
) -> str:
    """Hex SHA-256 naming this model computing KV in this format in blocks of this size: every
    field that changes what a block's tensors mean (weights digest, compute dtype, KV format,
    block size), JSON-encoded so no two field tuples collide."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    payload = json.dumps(
        [FINGERPRINT_VERSION, model_path_identity, weights_digest, dtype, kv_format, block_size],
        ensure_ascii=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(payload.encode("ascii")).hexdigest()


def _edges_digest(path: Path, size: int) -> str:
    """SHA-256 of the first and last MiB: catches re-downloads and edits without reading GBs."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(_EDGE_BYTES))
        if size > _EDGE_BYTES:
            f.seek(max(_EDGE_BYTES, size - _EDGE_BYTES))
            h.update(f.read(_EDGE_BYTES))
    return h.hexdigest()


def weights_digest(model_dir: Path) -> str:
    """A cheap, change-sensitive digest of a model folder: per weight file (sorted, symlinks
    followed) its name, size, mtime_ns and SHA-256 of its first and last 1 MiB, plus the whole
    config.json."""
    # the edges keep this in milliseconds for a 100 GB model; size and mtime catch rewrites
    # in the middle
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    h.update(b"omlx-weights-v1\0")
    files = sorted(
        p for p in model_dir.iterdir() if p.name.endswith(_WEIGHT_SUFFIXES) and p.is_file()
    )
    for p in files:
        st = p.stat()
        h.update(p.name.encode("utf-8") + b"\0")
        h.update(f"{st.st_size}\0{st.st_mtime_ns}\0".encode("ascii"))
        h.update(_edges_digest(p, st.st_size).encode("ascii") + b"\0")
    config = model_dir / "config.json"
    if config.is_file():
        h.update(b"config.json\0")
        h.update(config.read_bytes())
    else:
        h.update(b"no-config\0")
    return h.hexdigest()


def _pack_tokens(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes; a ValueError for one negative or >= 2**32 (a
    list goes through `array.array`, which checks as it converts)."""
    if isinstance(token_ids, list) and _UINT32.itemsize == 4:
        try:
            packed = array.array("I", token_ids)
        except OverflowError as exc:
            raise ValueError(f"token ids must fit in uint32: {exc}") from None
        except TypeError as exc:
            raise TypeError(f"token ids must be integers: {exc}") from None
        if sys.byteorder == "big":
            packed.byteswap()
        return packed.tobytes()
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype != np.dtype("<u4"):
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi > 0xFFFFFFFF:
            raise ValueError(f"token ids must fit in uint32, got range [{lo}, {hi}]")
        arr = arr.astype("<u4")
    return arr.tobytes()


def block_keys(
    fingerprint: str,
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    extra_keys: ExtraKeys | None = None,
) -> list[str]:
    """Chained hex keys, one per full block: key_i = sha256(fingerprint || key_{i-1} (b"root" first) ||
    block i's tokens as uint32le, each followed by its extra key if any: `_extra`); an extra key (an
    image's digest at its first token) changes its block and, through the chain, every later one."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    packed = _pack_tokens(token_ids)
    n_blocks = len(packed) // (4 * block_size)
    model = fingerprint.encode("ascii")
    stride = 4 * block_size
    view = memoryview(packed)
    extras = _extras_by_block(extra_keys, block_size) if extra_keys else {}
    keys: list[str] = []
    parent = _ROOT
    sha256 = hashlib.sha256
    for i in range(n_blocks):
        h = sha256(model)
        h.update(parent)
        _update(h, view[i * stride : (i + 1) * stride], extras.get(i))
        key = h.hexdigest()
        keys.append(key)
        parent = key.encode("ascii")
    return keys


def relative(extra_keys: ExtraKeys | None, start: int, end: int | None = None) -> dict[int, bytes]:
    """The extra keys of positions `start` to `end` (None: on), counted from `start`."""
    if not extra_keys:
        return {}
    return {p - start: v for p, v in extra_keys.items() if p >= start and (end is None or p < end)}


def _extras_by_block(extra_keys: ExtraKeys, block_size: int) -> dict[int, dict[int, bytes]]:
    out: dict[int, dict[int, bytes]] = {}
    for position, value in extra_keys.items():
        if position < 0:
            raise ValueError(f"an extra key's position must not be negative, got {position}")
        block, at = divmod(position, block_size)
        out.setdefault(block, {})[at] = value
    return out


def _extra(value: bytes) -> bytes:
    """An extra key as a block's message holds it: 0xFFFFFFFF (no token id) and its length, uint32le."""
    return struct.pack("<II", _NO_TOKEN, len(value)) + value


def _update(h: Any, packed: memoryview, extras: Mapping[int, bytes] | None) -> None:
    """`packed` tokens into `h`, each followed by its extra key (`extras`: position in `packed` → bytes)."""
    if not extras:
        h.update(packed)
        return
    at = 0
    for position in sorted(p for p in extras if 4 * p < len(packed)):
        h.update(packed[at : 4 * (position + 1)])
        h.update(_extra(extras[position]))
        at = 4 * (position + 1)
    h.update(packed[at:])


def tail_keys(
    fingerprint: str, parent: str | None, token_ids: Sequence[int] | np.ndarray, extra_keys: ExtraKeys | None = None
) -> list[str]:
    """`chain_key(fingerprint, parent, token_ids[:n], extra_keys)` for every n from 1 to len(token_ids),
    hashed incrementally: each key's message is a prefix of the next one's (a tail search asks for
    up to 255 of them in one pass)."""
    packed = memoryview(_pack_tokens(token_ids))
    h = hashlib.sha256(fingerprint.encode("ascii"))
    h.update(parent.encode("ascii") if parent else _ROOT)
    keys = []
    for i in range(0, len(packed), 4):
        h.update(packed[i : i + 4])
        if extra_keys and i // 4 in extra_keys:
            h.update(_extra(extra_keys[i // 4]))
        keys.append(h.copy().hexdigest())
    return keys


def chain_key(
    fingerprint: str, parent: str | None, token_ids: Sequence[int] | np.ndarray, extra_keys: ExtraKeys | None = None
) -> str:
    """The key of one block of any length after `parent` (`extra_keys` counted from its first
    token), by `block_keys`' formula: a full block's key is `block_keys`' own, and a shorter run
    never collides with one."""
    h = hashlib.sha256(fingerprint.encode("ascii"))
    h.update(parent.encode("ascii") if parent else _ROOT)
    _update(h, memoryview(_pack_tokens(token_ids)), extra_keys)
    return h.hexdigest()
