"""The admin dashboard at /admin and its JSON API: sessions and sub-keys, system view, global
settings, logs, model files, downloads from the Hugging Face hub and benchmarks.

`install_admin(app)` wires all of it into the app built by `omlx.server.app.create_app`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"


def install_admin(app: FastAPI) -> None:
    from omlx.admin import bench, documents, downloads, routes
    from omlx.admin.history import FILE_NAME, History
    from omlx.admin.log_buffer import install_log_buffer
    from omlx.admin.security import ApiKeyStore, LoginThrottle, SessionSigner, secret_from_env
    from omlx.platform_info import device_info

    state = app.state
    settings = state.settings
    state.log_buffer = install_log_buffer()
    state.sessions = SessionSigner(secret_from_env(), settings.api_key)
    state.api_keys = ApiKeyStore(settings.home / "api_keys.json")
    state.login_throttle = LoginThrottle()
    state.device = device_info()  # once, at start: the event loop never calls MLX
    state.bench = bench.BenchRunner(state.pool)
    state.history = History(state.metrics, state.pool, state.cache, settings.home / FILE_NAME)

    # Discovery builds a new snapshot and swaps it in, so a download thread may refresh it.
    state.downloads = downloads.DownloadManager(settings, on_complete=state.pool.refresh)

    app.include_router(routes.public)
    app.include_router(routes.router)
    app.include_router(downloads.router)
    app.include_router(bench.router)
    app.include_router(documents.router)
    app.mount("/admin/static", StaticFiles(directory=STATIC), name="admin-static")

    index = STATIC / "index.html"
    headers = {"Cache-Control": "no-cache", "X-Frame-Options": "DENY", "Referrer-Policy": "same-origin",
               "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; "
                                          "script-src 'self'; connect-src 'self'; frame-ancestors 'none'"}

    @app.get("/admin", include_in_schema=False)
    async def admin_page() -> Any:
        return FileResponse(index, headers=headers)

    @app.get("/admin/", include_in_schema=False)
    async def admin_slash() -> Any:
        return RedirectResponse("/admin")


def start_admin(app: FastAPI) -> None:
    """Start sampling the charts' history (from the app's lifespan, on the event loop)."""
    app.state.history.start()


def shutdown_admin(app: FastAPI) -> None:
    """Stop running downloads and benchmarks, save the history (from the app's lifespan)."""
    state = app.state
    if getattr(state, "history", None) is not None:
        state.history.stop()
    if getattr(state, "downloads", None) is not None:
        state.downloads.shutdown()
    if getattr(state, "bench", None) is not None:
        state.bench.shutdown()
