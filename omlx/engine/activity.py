"""Which engines of this process have requests. Engines of several models share one device,
so an engine's optional GPU work while it is idle (the attention-graph warm-up,
graph_warmup.py) waits while any other engine serves: it would slow that engine's requests
by more than the one chunk a request of its own model waits for."""

from __future__ import annotations

import threading
import weakref
from typing import Any

_engines: weakref.WeakSet = weakref.WeakSet()
_lock = threading.Lock()


def register(engine: Any) -> None:
    """Count `engine`'s published `active_count` and `waiting_count` from now on."""
    with _lock:
        _engines.add(engine)


def unregister(engine: Any) -> None:
    """`engine` stopped: whatever counts it last published no longer hold others back."""
    with _lock:
        _engines.discard(engine)


def others_busy(engine: Any) -> bool:
    """Whether an engine other than `engine` has requests running or waiting."""
    with _lock:
        others = [e for e in _engines if e is not engine]
    return any(getattr(e, "active_count", 0) or getattr(e, "waiting_count", 0) for e in others)
