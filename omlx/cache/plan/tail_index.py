"""The token-level tail index: for each parent block, the children this process stored with
their tokens, so a prompt that re-renders history differently still reuses everything up to
its first differing token (bounded bookkeeping, oldest parents forgotten first)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from types import MappingProxyType

MAX_PARENTS = 50_000  # ~1 KB per entry
MAX_SIBLINGS = 16
_NO_EXTRAS: Mapping[int, bytes] = MappingProxyType({})  # most children: text only


class TailIndex:
    """parent key ("" = root) → children stored by this process, with their tokens and extra keys
    (positions counted from the child's first token: an image's digest at its first token)."""

    def __init__(self) -> None:
        self._children: OrderedDict[str, list[tuple[str, tuple[int, ...], Mapping[int, bytes]]]] = OrderedDict()

    def remember(self, parent: str | None, key: str, tokens: list[int], extras: Mapping[int, bytes] | None = None) -> None:
        siblings = self._children.setdefault(parent or "", [])
        self._children.move_to_end(parent or "")
        if all(k != key for k, _, _ in siblings):
            siblings.append((key, tuple(tokens), dict(extras) if extras else _NO_EXTRAS))
            del siblings[:-MAX_SIBLINGS]
        while len(self._children) > MAX_PARENTS:
            self._children.popitem(last=False)

    def candidates(
        self, parent: str | None, rest: list[int], extras: Mapping[int, bytes] | None = None
    ) -> list[tuple[int, str]]:
        """(tokens shared with `rest` and its `extras`, key) of `parent`'s children, the most shared first."""
        return sorted(
            ((shared_prefix(toks, own, rest, extras), key) for key, toks, own in self._children.get(parent or "", ())),
            reverse=True,
        )

    def best(
        self, parent: str | None, rest: list[int], extras: Mapping[int, bytes] | None = None
    ) -> tuple[int, str, int] | None:
        """(tokens shared with `rest`, key, its own tokens) of `parent`'s child sharing the most, the
        longest of those first; None when `parent` has none (the reason a restore ends: cache-explain.md)."""
        children = self._children.get(parent or "", ())
        found = [(shared_prefix(toks, own, rest, extras), len(toks), key) for key, toks, own in children]
        if not found:
            return None
        shared, length, key = max(found)
        return shared, key, length


def shared_prefix(
    a: tuple[int, ...], a_extras: Mapping[int, bytes], b: list[int], b_extras: Mapping[int, bytes] | None
) -> int:
    """Tokens `a` and `b` share from the start, up to the first position whose extra keys differ."""
    n = common_prefix(a, b)
    if not a_extras and not b_extras:
        return n
    b_extras = b_extras or _NO_EXTRAS
    for position in sorted({*a_extras, *b_extras}):
        if position >= n:
            break
        if a_extras.get(position) != b_extras.get(position):
            return position
    return n


def common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
