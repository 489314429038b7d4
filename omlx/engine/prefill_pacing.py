"""Prompt chunks sized by time: each takes about `TARGET_CHUNK_S`, so a cancel, a newcomer or
the other streams' next token never wait longer than about one chunk.

An engine acts between chunks only. On a slow device chunks shrink until they take about the
target (prefill throughput there is set by attention over the context, not the chunk's size:
docs/design/prefill-pacing.md). Where chunks are fast (a GPU) they stay at their step, on the
grid their attention graphs were built for.
"""

from __future__ import annotations

TARGET_CHUNK_S = 0.4
MIN_CHUNK = 32
SHRINK_ABOVE = 1.5  # x the target: a chunk that took longer makes the next one smaller


def paced_step(step: int, largest: int, tokens: int, seconds: float, quantum: int = 0) -> int:
    """The next chunk's length after `tokens` took `seconds` at chunk length `step`: shrunk
    toward `TARGET_CHUNK_S` when a chunk took over `SHRINK_ABOVE` times that, grown back (up to
    `largest`) when it took under half; a multiple of `quantum` when one is set."""
    unit = max(MIN_CHUNK, quantum)
    if seconds > SHRINK_ABOVE * TARGET_CHUNK_S and tokens > 0:
        wanted = int(tokens * TARGET_CHUNK_S / seconds)
    elif seconds < TARGET_CHUNK_S / 2 and step < largest:
        wanted = step * 2
    else:
        return step
    wanted = max(unit, wanted // unit * unit) if quantum else max(unit, wanted)
    return min(largest, wanted)
