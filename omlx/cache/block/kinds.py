"""Per-layer cache kinds of a model, read from its mlx-lm `make_cache()`: KV layers are cut into
token ranges, rotating windows and recurrent arrays are kept whole at block boundaries
(docs/design/cache-kinds.md). A `CacheList` layer is flattened into its leaves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache, make_prompt_cache

KV = "kv"
ROTATING = "rotating"
ARRAYS = "arrays"


@dataclass(frozen=True)
class LeafKind:
    """One leaf cache's kind; `window`/`keep` for a rotating window, `slots` for arrays."""

    kind: str
    window: int = 0
    keep: int = 0
    slots: int = 0

    def tag(self) -> str:
        """The kind as the block files and the fingerprint name it ("rotating:128:0" ...)."""
        if self.kind == ROTATING:
            return f"{ROTATING}:{self.window}:{self.keep}"
        if self.kind == ARRAYS:
            return f"{ARRAYS}:{self.slots}"
        return KV


@dataclass(frozen=True)
class CacheKinds:
    """A model's leaf kinds in order, and per model layer its `CacheList`'s number of parts
    (0: the layer is one plain leaf)."""

    leaves: tuple[LeafKind, ...]
    groups: tuple[int, ...]

    @property
    def plain_kv(self) -> bool:
        """Every layer a plain `KVCache`: blocks are made and read as before kinds existed."""
        return all(k.kind == KV for k in self.leaves) and not any(self.groups)

    @property
    def stateful(self) -> bool:
        """Some leaf keeps a state that must be captured at block boundaries."""
        return any(k.kind != KV for k in self.leaves)

    def tags(self) -> list[str]:
        return [k.tag() for k in self.leaves]

    def kv_format(self) -> str:
        """The fingerprint's KV-format field: "kv" for plain-KV models (their keys unchanged),
        else every leaf's kind and the layer grouping."""
        if self.plain_kv:
            return KV
        return "kinds1:" + ",".join(self.tags()) + "/" + ",".join(map(str, self.groups))


def leaf_kind(cache: Any) -> LeafKind | None:
    """The kind of one leaf cache; None for a class the prefix cache cannot keep."""
    if type(cache) is KVCache:
        return LeafKind(KV)
    if type(cache) is RotatingKVCache:
        return LeafKind(ROTATING, window=int(cache.max_size), keep=int(cache.keep))
    if type(cache) is ArraysCache:
        return LeafKind(ARRAYS, slots=len(cache.cache))
    return None


def cache_kinds(cache: list[Any]) -> tuple[CacheKinds | None, str]:
    """The kinds of a fresh model cache, or (None, why not) when a layer is of a class the
    prefix cache cannot keep (QuantizedKVCache, ChunkedKVCache, a nested CacheList ...)."""
    leaves: list[LeafKind] = []
    groups: list[int] = []
    unknown: set[str] = set()
    for layer in cache:
        parts = list(layer.caches) if type(layer) is CacheList else [layer]
        for part in parts:
            kind = leaf_kind(part)
            if kind is None:
                unknown.add(type(part).__name__)
            else:
                leaves.append(kind)
        groups.append(len(parts) if type(layer) is CacheList else 0)
    if unknown:
        return None, f"its cache layers include {', '.join(sorted(unknown))}, which blocks cannot hold"
    return CacheKinds(tuple(leaves), tuple(groups)), ""


def model_kinds(model: Any) -> tuple[CacheKinds | None, str]:
    """`cache_kinds` of the model's own `make_cache()` (or mlx-lm's default)."""
    return cache_kinds(make_prompt_cache(model))


def flatten(cache: list[Any]) -> list[Any]:
    """A model cache's leaves in order (a `CacheList`'s parts in its place)."""
    return [part for layer in cache for part in (layer.caches if type(layer) is CacheList else [layer])]


def regroup(kinds: CacheKinds, leaves: list[Any]) -> list[Any]:
    """Leaves back into the model's per-layer caches (`CacheList`s where the model has them)."""
    out: list[Any] = []
    at = 0
    for n in kinds.groups:
        out.append(leaves[at] if n == 0 else CacheList(*leaves[at : at + n]))
        at += max(1, n)
    return out
