#!/usr/bin/env python
"""Summarise a `py-spy record -f raw --threads` file: samples per thread, then the functions
with the most inclusive samples in each thread (what the engine thread, the event loop and
the SSD writer spend their time on). Usage: pyspy_summary.py FILE [TOP]"""

from __future__ import annotations

import sys
from collections import Counter


def main() -> None:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 15
    per_thread: Counter[str] = Counter()
    inclusive: Counter[tuple[str, str]] = Counter()
    for line in open(path, encoding="utf-8", errors="replace"):
        line = line.rstrip()
        if not line or " " not in line:
            continue
        stack, count = line.rsplit(" ", 1)
        n = int(count)
        frames = stack.split(";")
        thread = frames[0]
        per_thread[thread] += n
        seen = set()
        for frame in frames[1:]:
            if frame not in seen:  # a frame is function (file:line)
                inclusive[(thread, frame)] += n
                seen.add(frame)
    for thread, total in per_thread.most_common():
        print(f"{total:6d}  {thread}")
        rows = [(f, n) for (t, f), n in inclusive.items() if t == thread]
        for frame, n in sorted(rows, key=lambda x: -x[1])[:top]:
            print(f"        {n:6d} {100 * n / total:5.1f}%  {frame[:140]}")


if __name__ == "__main__":
    main()
