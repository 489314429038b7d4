"""The unit of caching: one immutable, content-addressed block of KV state (every layer's
tensors for `token_count` tokens at a fixed place in a prefix, `block_hash.block_keys`), its
host-bytes form, and its integrity checksum."""

from __future__ import annotations

import functools
import hashlib
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from omlx.platform_info import discrete_gpu

__all__ = [
    "CacheBlock", "HostBlock", "HostTensors", "checksum", "checksum_host", "checksum_matches", "dtype_name",
    "from_host", "host_reads_move_buffers", "host_view", "is_state_tensor", "packed", "packed_on_host",
    "staged_on_host", "to_host",
]

# name -> (MLX dtype name, shape, the tensor's raw bytes as a flat uint8 array)
HostTensors = dict[str, tuple[str, tuple[int, ...], np.ndarray]]


def is_state_tensor(name: str) -> bool:
    """Whether a block tensor is part of a stateful leaf's whole state (`layer_states`: a
    rotating window or recurrent arrays), not a KV token range."""
    return ".window." in name or ".arrays." in name


@dataclass
class CacheBlock:
    """One block of KV state: evaluated arrays it owns, for `token_count` tokens after the
    block `parent` (None: the root); `layer_types` says per layer which cache kind the tensors
    rebuild ("kv", "rotating", "mamba" ...)."""

    key: str
    parent: str | None
    fingerprint: str
    token_count: int
    layer_types: list[str]
    tensors: dict[str, mx.array] = field(repr=False)
    # only some of its tensors (a KV-only or state-only read): the hot tier keeps a KV-only one
    # as such (`Residency.KV_ONLY`), no other tier keeps or writes it (docs/design/cache-kinds.md)
    partial: bool = False

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of tensor data (what the byte budgets of the tiers count); a block's tensors
        never change, and a lookup asks for a whole run's sizes (125 blocks for 32,000 tokens,
        each of one stacked tensor or of 32 or 64)."""
        return sum(int(t.nbytes) for t in self.tensors.values())


@dataclass
class HostBlock:
    """A block as host bytes (`host`): what the RAM tier keeps and the SSD threads write and
    read. A RAM block is `staged`: one MLX array that `host` views (docs/design/ram-moves.md);
    other threads touch only `host`, never the array."""

    key: str
    parent: str | None
    fingerprint: str
    token_count: int
    layer_types: list[str]
    host: HostTensors = field(repr=False)
    staged: mx.array | None = field(default=None, repr=False, compare=False)
    partial: bool = False  # as `CacheBlock.partial`

    def part(self, state: bool) -> HostBlock:
        """A partial view of this block: its state tensors (`state`) or its KV tensors alone."""
        host = {name: t for name, t in self.host.items() if is_state_tensor(name) == state}
        return HostBlock(self.key, self.parent, self.fingerprint, self.token_count, list(self.layer_types), host, partial=True)

    @functools.cached_property
    def nbytes(self) -> int:
        return sum(int(data.nbytes) for _, _, data in self.host.values())

    @classmethod
    def of(cls, block: CacheBlock, *, copy: bool) -> HostBlock:
        """`block`'s bytes (engine thread). `copy` detaches them from the block's device
        buffers, staged in host memory (for the RAM tier); the SSD writer only needs a view,
        which on a CUDA GPU is a view of a packed copy (`packed_on_host`)."""
        if copy:
            staged, host = staged_on_host(block.tensors)
        else:
            staged, host = None, packed_on_host(block.tensors) if host_reads_move_buffers() else to_host(block.tensors)
        return cls(
            block.key, block.parent, block.fingerprint, block.token_count, list(block.layer_types), host, staged,
            block.partial,
        )

    def to_block(self, *, move: bool = False) -> CacheBlock:
        """MLX arrays again (engine thread): new ones made from the bytes, or with `move`, for
        a staged block, views of its staged array (no copy: on a CUDA GPU its pages migrate to
        the device at first use, so its holder should let it go)."""
        return CacheBlock(
            key=self.key,
            parent=self.parent,
            fingerprint=self.fingerprint,
            token_count=self.token_count,
            layer_types=list(self.layer_types),
            tensors=from_host(self.host, whole=self.staged if move else None),
            partial=self.partial,
        )


def dtype_name(dtype: mx.Dtype) -> str:
    """Stable short dtype name (``"bfloat16"``), independent of how MLX prints dtypes."""
    return str(dtype).rsplit(".", 1)[-1]


def host_view(t: mx.array) -> np.ndarray:
    """A C-contiguous numpy array with exactly `t`'s bytes (bf16 viewed as uint16), made on
    the CPU stream so it is safe from any thread."""
    with mx.stream(mx.cpu):
        if t.dtype == mx.bfloat16:
            t = t.view(mx.uint16)
        arr = np.asarray(t)
    return np.ascontiguousarray(arr)


def to_host(tensors: Mapping[str, mx.array]) -> HostTensors:
    """The raw bytes of each tensor in host memory (zero-copy for evaluated CPU arrays); call
    on the thread that owns the model, so that the SSD threads only touch bytes."""
    return {
        name: (dtype_name(t.dtype), tuple(t.shape), host_view(t).reshape(-1).view(np.uint8))
        for name, t in tensors.items()
    }


_MX_DTYPES = {"bool": mx.bool_}  # `dtype_name`s that are not the attribute's name


def packed(host: HostTensors) -> HostTensors:
    """A copy of `host` whose tensors are consecutive views of one buffer (as a block read
    from the SSD already is), each at an offset its dtype's size divides: `from_host` then
    makes one MLX array of it, not one per tensor."""
    starts, at = [], 0
    for dt, _, data in host.values():
        at = -(-at // _itemsize(dt)) * _itemsize(dt)
        starts.append(at)
        at += data.nbytes
    buffer = np.empty(at, dtype=np.uint8)
    out = {}
    for (name, (dt, shape, data)), a in zip(host.items(), starts, strict=True):
        view = buffer[a : a + data.nbytes]
        view[:] = data
        out[name] = (dt, shape, view)
    return out


def host_reads_move_buffers() -> bool:
    """Whether a host read of a device array moves its buffer for good: on CUDA, MLX turns the
    buffer of an array the host reads into managed memory, whose pages then wander to the host
    and back (`packed_on_host`). Elsewhere (a CPU, Apple silicon) the host reads it in place."""
    return discrete_gpu()


def packed_on_host(tensors: Mapping[str, mx.array]) -> HostTensors:
    """Host views of a copy of `tensors` packed on the device into one new array, for the SSD
    writer to read a block the hot tier keeps without moving its buffers (docs/design/write-back.md)."""
    whole, layout = _packed(tensors)
    if whole is None:
        return {}
    buffer = host_view(whole)  # views it: the numpy array keeps `whole` alive
    return {name: (dt, shape, buffer[a : a + n]) for name, dt, shape, a, n in layout}


def staged_on_host(tensors: Mapping[str, mx.array]) -> tuple[mx.array | None, HostTensors]:
    """`tensors` packed on the device and copied out in one piece into a new MLX array whose
    pages lie in host memory, with views of it as host bytes: a RAM block (docs/design/ram-moves.md)."""
    whole, layout = _packed(tensors)
    if whole is None:
        return None, {}
    with mx.stream(mx.cpu):
        staged = mx.array(np.asarray(whole))  # one host copy: reads the device's pages, writes new ones
        mx.eval(staged)
        buffer = np.asarray(staged)  # a view: its pages are the array's
    return staged, {name: (dt, shape, buffer[a : a + n]) for name, dt, shape, a, n in layout}


def _packed(tensors: Mapping[str, mx.array]) -> tuple[mx.array | None, list[tuple[str, str, tuple[int, ...], int, int]]]:
    """`tensors` as one evaluated uint8 array on the device, each at an offset its dtype's
    size divides, and (name, dtype, shape, offset, bytes) of each."""
    parts: list[mx.array] = []
    layout = []
    at = 0
    for name, t in tensors.items():
        dt = dtype_name(t.dtype)
        pad = -at % _itemsize(dt)
        if pad:
            parts.append(mx.zeros((pad,), dtype=mx.uint8))
            at += pad
        parts.append(t.reshape(-1).view(mx.uint8))
        layout.append((name, dt, tuple(t.shape), at, int(t.nbytes)))
        at += int(t.nbytes)
    if not parts:
        return None, layout
    # always a new buffer (the callers' point): one tensor (a stacked block) would otherwise be
    # returned as a view of the block's own, which `mx.contiguous` and a one-input
    # concatenation also return
    whole = parts[0] + 0 if len(parts) == 1 else mx.concatenate(parts)
    mx.eval(whole)
    return whole, layout


def _itemsize(dt: str) -> int:
    return 2 if dt == "bfloat16" else np.dtype(dt).itemsize


def from_host(host: HostTensors, whole: mx.array | None = None) -> dict[str, mx.array]:
    """MLX arrays from host bytes (engine thread), views of one array where the bytes lie in
    one buffer; with `whole` (a staged block's array), views of it instead of copies."""
    if whole is not None:
        origin = _address(np.asarray(whole))
        return {
            name: _typed(whole, _address(data) - origin, data.nbytes, dt, shape)
            for name, (dt, shape, data) in host.items()
        }
    span = _one_buffer(host)
    if span is None:
        out = {}
        for name, (dt, shape, data) in host.items():
            if dt == "bfloat16":
                out[name] = mx.array(data.view(np.uint16).reshape(shape)).view(mx.bfloat16)
            else:
                out[name] = mx.array(data.view(np.dtype(dt)).reshape(shape))
        return out
    flat, starts = span
    whole = mx.array(flat)
    return {
        name: _typed(whole, a, data.nbytes, dt, shape)
        for (name, (dt, shape, data)), a in zip(host.items(), starts, strict=True)
    }


def _typed(whole: mx.array, at: int, nbytes: int, dt: str, shape: tuple[int, ...]) -> mx.array:
    """The tensor of `dt` and `shape` at byte `at` of the uint8 array `whole` (a view)."""
    return whole[at : at + nbytes].view(_MX_DTYPES.get(dt) or getattr(mx, dt)).reshape(shape)


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _one_buffer(host: HostTensors) -> tuple[np.ndarray, list[int]] | None:
    """(the bytes spanning all of `host`'s tensors, each tensor's offset in them) when they all
    lie in one host buffer, each at an offset its dtype's size divides; else None."""
    if len(host) < 2:
        return None
    datas = [data for _, _, data in host.values()]
    base = datas[0].base
    if base is None or any(d.base is not base or not d.flags.c_contiguous for d in datas):
        return None
    addresses = [d.__array_interface__["data"][0] for d in datas]
    lo = min(addresses)
    hi = max(a + d.nbytes for a, d in zip(addresses, datas, strict=True))
    if hi - lo > sum(d.nbytes for d in datas) + 8 * len(datas):  # a part of a block: not the rest's bytes too
        return None
    starts = [a - lo for a in addresses]
    itemsizes = [_itemsize(dt) for dt, _, _ in host.values()]
    if any(start % size for start, size in zip(starts, itemsizes, strict=True)):
        return None
    origin = base.__array_interface__["data"][0] if isinstance(base, np.ndarray) else None
    if origin is None or base.ndim != 1 or base.dtype != np.uint8:
        return None
    return base[lo - origin : hi - origin], starts


CRC_PREFIX = "crc32:"


def checksum_host(host: HostTensors) -> str:
    """`checksum` over host bytes: pure hashing, safe on any thread."""
    crc = 0
    for header, data in _checksum_entries(host):
        crc = zlib.crc32(data, zlib.crc32(header, crc))
    return f"{CRC_PREFIX}{crc:08x}"


def checksum_matches(host: HostTensors, stored: str) -> bool:
    """Verify host bytes against a stored checksum: CRC-32, or SHA-256 (64 hex digits, what
    older files carry), so existing cache files stay valid."""
    if stored.startswith(CRC_PREFIX):
        return checksum_host(host) == stored
    h = hashlib.sha256(b"omlx-block-checksum-v1\0")
    for header, data in _checksum_entries(host):
        h.update(header)
        h.update(data)
    return h.hexdigest() == stored


def _checksum_entries(host: HostTensors) -> Iterable[tuple[bytes, memoryview]]:
    for name in sorted(host):
        dt, shape, data = host[name]
        view = memoryview(data)
        yield f"{name}\0{dt}\0{','.join(map(str, shape))}\0{view.nbytes}\0".encode(), view


def checksum(tensors: Mapping[str, mx.array]) -> str:
    """CRC-32 over tensor names, dtypes, shapes and raw bytes in sorted name order: stored with
    each SSD block and verified on load, against accidents, not adversaries (docs/design/write-back.md)."""
    return checksum_host(to_host(tensors))
