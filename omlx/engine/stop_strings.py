"""Stop strings over streamed text: cut at the first match, never send the stop text.

Text that could still turn into a stop string is held back until the next
segment decides it, so a client never sees a partial stop string.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.matched: str | None = None  # the stop string that ended the output

    def feed(self, segment: str, final: bool = False) -> tuple[str, bool]:
        """Returns (text safe to send now, whether a stop string matched)."""
        if not self.stops:
            return segment, False
        text = self._held + segment
        first = -1
        for stop in self.stops:
            pos = text.find(stop)
            if pos != -1 and (first == -1 or pos < first):
                first, self.matched = pos, stop
        if first != -1:
            self._held = ""
            return text[:first], True
        if final:
            self._held = ""
            return text, False
        keep = self._longest_partial(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def _longest_partial(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:n]):
                    best = n
                    break
        return best
