"""How long the `SpecBatch` may make its verify step, from what its steps cost (pure Python; engine
thread; docs/design/speculation.md, "What a wider step costs").

A step of B rows, each fed `w` tokens, is taken to cost `plain(B) * (1 + extra(B) * (w - 1))`: both
are learnt from the steps made (moving averages of their seconds). A row whose drafts were accepted
`kept` tokens and rejected `misses` times is taken to accept each next draft token with probability
q = (kept + 1) / (kept + misses + 2). `cap` picks the draft length k that makes the most tokens per
second, (B + sum of the rows' expected accepted tokens) / (1 + extra * k), 0 where no length beats a
plain step. A plain step is made every `REFRESH` steps (depth changes what it costs), and a full one
after `EXPLORE` steps without drafts, so both figures stay current.
"""

from __future__ import annotations

REFRESH = 32  # steps at a batch size after which a plain step measures it again
EXPLORE = 64  # steps without a wide one after which drafting is tried again
SMOOTHING = 0.25  # weight of a new measurement in the moving averages
MAX_EXTRA = 4.0  # a wider step's relative cost per token, at most (a noisy step)


class VerifyCost:
    """What plain and wider steps cost per batch size, and the draft length worth verifying."""

    def __init__(self) -> None:
        self.plain: dict[int, float] = {}  # seconds of a one-token step, by rows
        self.extra: dict[int, float] = {}  # relative cost of each token more per row, by rows
        self.since_plain: dict[int, int] = {}
        self.since_wide: dict[int, int] = {}

    def cap(self, rows: list[tuple[float, int]]) -> int:
        """The draft length to verify for `rows` (each: acceptance q, draft length): 0 for a plain step."""
        longest = max((n for _, n in rows), default=0)
        size = len(rows)
        if not longest or size not in self.plain or self.since_plain.get(size, 0) >= REFRESH:
            return 0
        extra = self.extra.get(size)
        if extra is None or self.since_wide.get(size, 0) >= EXPLORE:
            return longest
        best, value = 0, float(size)
        for k in range(1, longest + 1):
            tokens = size + sum(expected(q, min(n, k)) for q, n in rows)
            if tokens / (1 + extra * k) > value:
                best, value = k, tokens / (1 + extra * k)
        return best

    def observe(self, rows: int, width: int, seconds: float) -> None:
        """A step of `rows` rows fed `width` tokens each took `seconds`."""
        self.since_plain[rows] = self.since_plain.get(rows, 0) + 1
        self.since_wide[rows] = self.since_wide.get(rows, 0) + 1
        if width == 1:
            self.plain[rows] = _average(self.plain.get(rows), seconds)
            self.since_plain[rows] = 0
            return
        plain = self.plain.get(rows)
        if plain:
            extra = min(MAX_EXTRA, max(0.0, (seconds / plain - 1) / (width - 1)))
            self.extra[rows] = _average(self.extra.get(rows), extra)
            self.since_wide[rows] = 0


def acceptance(kept: int, misses: int) -> float:
    """A row's chance of accepting a next draft token: `kept` accepted, `misses` drafts cut short."""
    return (kept + 1) / (kept + misses + 2)


def expected(q: float, n: int) -> float:
    """Tokens a draft of `n` accepts when each is accepted with probability `q` after the one before."""
    return sum(q**j for j in range(1, n + 1))


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)


__all__ = ["VerifyCost", "acceptance", "expected"]
