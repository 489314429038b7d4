"""What the server does once it listens: load the warm-start models (`pool.models_to_warm`),
one at a time, while `/health` answers 503 `{"status": "loading"}`; then log the URL it serves.

A model that fails to load is logged and skipped: the server serves the others (and a request
for that model gets its 503 `model_load_failed`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from omlx.errors import OMLXError

log = logging.getLogger("omlx.server")
ready_log = logging.getLogger("omlx.ready")
ready_log.setLevel(logging.INFO)  # the URL line shows at any --log-level


class StartState:
    """The models still to load before the server is ready (event loop only)."""

    def __init__(self, models: list[str]):
        self.pending = list(models)

    @property
    def ready(self) -> bool:
        return not self.pending


def public_url(host: str, port: int) -> str:
    """The URL a local client uses for a server bound to `host`."""
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def load_at_start(app: Any, listening: Callable[[], bool]) -> None:
    """Load `app.state.start.pending` in order; once done and `listening()`, log the URL."""
    state, pool, settings = app.state.start, app.state.pool, app.state.settings
    while state.pending:
        model_id = state.pending[0]
        log.info("loading %s at start", model_id)
        try:
            await asyncio.create_task(pool.load(model_id))  # its log lines name it; the later ones not
        except OMLXError as exc:
            log.error("could not load %s at start: %s", model_id, exc.message)
        finally:
            state.pending.pop(0)
    while not listening():
        await asyncio.sleep(0.05)
    url = public_url(settings.host, settings.port)
    ready_log.info("ready: %s (dashboard %s/admin)", url, url)
