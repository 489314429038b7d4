"""A bounded in-memory log: the last N formatted records, numbered, for the dashboard's live tail."""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any


class LogBuffer(logging.Handler):
    def __init__(self, capacity: int = 2000):
        super().__init__()
        self.capacity = capacity
        self._lines: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._seq = 0
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.exc_info:
                message += "\n" + logging.Formatter().formatException(record.exc_info)
        except Exception:  # a bad format string must not break logging
            message = str(record.msg)
        with self._lock:
            self._seq += 1
            self._lines.append(
                {
                    "seq": self._seq,
                    "time": record.created,
                    "level": record.levelname,
                    "logger": record.name,
                    "message": message,
                }
            )

    def since(self, after: int, limit: int = 1000) -> dict[str, Any]:
        """Lines with `seq > after` (oldest first, at most `limit`, the newest kept)."""
        with self._lock:
            lines = [line for line in self._lines if line["seq"] > after]
            last = self._seq
        lines = lines[-limit:]
        return {"lines": lines, "last": last, "capacity": self.capacity}


def install_log_buffer(capacity: int = 2000) -> LogBuffer:
    """Attach one buffer to the root logger: every `omlx.*` logger reaches it."""
    root = logging.getLogger()
    for handler in root.handlers:
        if isinstance(handler, LogBuffer):
            return handler
    buffer = LogBuffer(capacity)
    root.addHandler(buffer)
    return buffer
