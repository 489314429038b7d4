"""Admin JSON API for the dashboard: login, system view, global settings, logs, sub-keys, model files."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import psutil
from fastapi import APIRouter, Depends, Request, Response

from omlx import __version__
from omlx.admin.bodies import KeyBody, LoginBody, SettingsPatch, as_sent
from omlx.cache.sizes import parse_size
from omlx.errors import (
    AuthenticationError,
    ConfigError,
    ConflictError,
    InvalidRequestError,
    OverloadedError,
)
from omlx.server.auth import (
    SESSION_COOKIE,
    check_origin,
    has_session,
    key_matches,
    require_admin,
)
from omlx.settings import SETTINGS, SETTINGS_BY_NAME, convert, read_settings_file, settings_file

log = logging.getLogger("omlx.admin")

# Settings the running server picks up at once; every other one applies at the next start.
LIVE_SETTINGS = {"default_max_tokens", "keepalive_interval", "idle_timeout", "log_level", "hf_endpoint",
                 "max_process_memory"}
# Not editable from the dashboard: the key is set by whoever starts the server.
READ_ONLY_SETTINGS = {"api_key"}
SIZE_SETTINGS = {"max_model_memory", "hot_cache_max_size", "ssd_cache_max_size", "max_process_memory"}

public = APIRouter(prefix="/api")  # login/logout/session: reachable without credentials
router = APIRouter(prefix="/api", dependencies=[Depends(require_admin)])


# ----- login -------------------------------------------------------------------------
@public.get("/auth/session")
async def session_state(request: Request) -> dict[str, Any]:
    required = bool(request.app.state.settings.api_key)
    return {"auth_required": required, "authenticated": (not required) or has_session(request)}


@public.post("/auth/login")
async def login(request: Request, response: Response, body: LoginBody) -> dict[str, Any]:
    check_origin(request)
    expected = request.app.state.settings.api_key
    if not expected:
        return {"auth_required": False, "authenticated": True}
    client = request.client.host if request.client else "?"
    throttle = request.app.state.login_throttle
    wait = throttle.retry_after(client)
    if wait:
        raise OverloadedError(f"Too many failed logins; try again in {wait} s.", retry_after=wait)
    key = body.api_key
    if not isinstance(key, str) or not key_matches(key, expected):
        throttle.failed(client)
        log.warning("failed dashboard login from %s", client)
        raise AuthenticationError("Wrong API key.", code="invalid_api_key")
    throttle.succeeded(client)
    signer = request.app.state.sessions
    response.set_cookie(
        SESSION_COOKIE,
        signer.issue(),
        max_age=signer.max_age,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path="/",
    )
    log.info("dashboard login from %s", client)
    return {"auth_required": True, "authenticated": True}


@public.post("/auth/logout")
async def logout(request: Request, response: Response) -> dict[str, Any]:
    check_origin(request)
    request.app.state.sessions.revoke(request.cookies.get(SESSION_COOKIE))
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
    return {"authenticated": False}


# ----- system ------------------------------------------------------------------------
@router.get("/system")
async def system(request: Request) -> dict[str, Any]:
    state = request.app.state
    pool = state.pool
    vm = psutil.virtual_memory()
    used_by_models = sum(e.memory for e in pool.entries.values())
    settings = state.settings
    return {
        "version": __version__,
        "uptime_s": time.time() - state.started,
        "host": settings.host,
        "port": settings.port,
        "auth_required": bool(settings.api_key),
        "device": state.device,
        "memory": {
            "total_bytes": vm.total,
            "available_bytes": vm.available,
            "process_rss_bytes": psutil.Process().memory_info().rss,
            "models_bytes": used_by_models,
            "models_limit_bytes": pool.max_memory,
        },
        "model_dir": str(settings.model_dir),
        "counters": state.metrics.snapshot(),
    }


@router.get("/history")
async def history(request: Request) -> dict[str, Any]:
    """The charts' points (admin/history.py), the last one live."""
    return request.app.state.history.view()


# ----- global settings ---------------------------------------------------------------
def _jsonable(value: Any) -> Any:
    return str(value) if isinstance(value, Path) else value


def _value_at_restart(name: str, settings: Any, file_values: dict[str, Any]) -> Any:
    """What the next start resolves `name` to (CLI and env keep winning over the file)."""
    s = SETTINGS_BY_NAME[name]
    if settings.sources.get(name) in ("cli", "env"):
        return settings.values[name]
    if name in file_values:
        return convert(s, file_values[name], "settings.json")
    if s.default is None and name in ("model_dir", "cache_dir"):
        return settings.home / ("models" if name == "model_dir" else "cache")
    return s.default


def settings_view(settings: Any) -> dict[str, Any]:
    try:
        file_values = read_settings_file()
        file_error = None
    except ConfigError as exc:
        file_values, file_error = {}, str(exc)
    items = []
    pending = []
    for s in SETTINGS:
        current = settings.values.get(s.name)
        try:
            at_restart = _value_at_restart(s.name, settings, file_values)
        except ConfigError as exc:  # a hand-edited file with a bad value: the next start fails
            at_restart, file_error = None, str(exc)
        if s.name not in LIVE_SETTINGS and at_restart != current:
            pending.append(s.name)
        secret = s.name == "api_key"
        items.append(
            {
                "name": s.name,
                "type": s.type.__name__ if s.type is not Path else "path",
                "value": ("***" if current else None) if secret else _jsonable(current),
                "file_value": None if secret else _jsonable(file_values.get(s.name)),
                "default": _jsonable(s.default) if s.default is not None else s.default_doc,
                "source": settings.sources.get(s.name, "default"),
                "help": s.help,
                "choices": list(s.choices) if s.choices else None,
                "minimum": s.minimum,
                "flag": s.flag,
                "env": s.env,
                "live": s.name in LIVE_SETTINGS,
                "editable": s.name not in READ_ONLY_SETTINGS,
            }
        )
    return {"file": str(settings_file()), "file_error": file_error, "settings": items, "restart_required": pending}


def _validate(name: str, raw: Any) -> Any:
    s = SETTINGS_BY_NAME.get(name)
    if s is None:
        raise InvalidRequestError(f"Unknown setting '{name}'.", param=name)
    if name in READ_ONLY_SETTINGS:
        raise InvalidRequestError(
            f"'{name}' cannot be changed from the dashboard; set {s.flag} or {s.env} when starting the server.",
            param=name,
        )
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return None  # back to the default
    if isinstance(raw, (dict, list)):
        raise InvalidRequestError(f"Invalid value for {name}: expected {s.type.__name__}.", param=name)
    try:
        value = convert(s, raw, "the dashboard")
    except ConfigError as exc:
        raise InvalidRequestError(str(exc), param=name) from None
    if name in SIZE_SETTINGS:
        try:
            parse_size(value, total=1 << 40)
        except ValueError as exc:
            raise InvalidRequestError(f"Invalid value for {name}: {exc}", param=name) from None
    if name == "hf_endpoint" and not str(value).startswith(("http://", "https://")):
        raise InvalidRequestError("Invalid value for hf_endpoint: expected an http(s) URL.", param=name)
    return value


def _apply_live(settings: Any, name: str, value: Any) -> None:
    if settings.sources.get(name) in ("cli", "env"):
        return  # the file does not override a flag or an environment variable
    s = SETTINGS_BY_NAME[name]
    settings.values[name] = s.default if value is None else value
    settings.sources[name] = "default" if value is None else "file"
    if name == "log_level":
        logging.getLogger().setLevel(settings.values[name].upper())


@router.get("/settings")
async def get_settings(request: Request) -> dict[str, Any]:
    return settings_view(request.app.state.settings)


@router.put("/settings")
async def put_settings(request: Request, body: SettingsPatch) -> dict[str, Any]:
    """Merge `{name: value}` into settings.json; `null` removes a name (back to its default)."""
    patch = as_sent(body)
    if not patch:
        raise InvalidRequestError("Send at least one setting.")
    validated = {name: _validate(name, raw) for name, raw in patch.items()}
    try:
        current = read_settings_file()
    except ConfigError as exc:
        raise InvalidRequestError(str(exc)) from None
    for name, value in validated.items():
        if value is None:
            current.pop(name, None)
        else:
            current[name] = _jsonable(value)
    path = settings_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(current, indent=2) + "\n")
    os.replace(tmp, path)
    settings = request.app.state.settings
    for name, value in validated.items():
        if name in LIVE_SETTINGS:
            _apply_live(settings, name, value)
    log.info("settings saved to %s: %s", path, ", ".join(sorted(validated)))
    return settings_view(settings)


# ----- logs --------------------------------------------------------------------------
@router.get("/logs")
async def logs(request: Request, after: int = 0, limit: int = 500) -> dict[str, Any]:
    if limit < 1 or limit > 2000:
        raise InvalidRequestError("limit must be between 1 and 2000.", param="limit")
    return request.app.state.log_buffer.since(after, limit)


# ----- sub-keys ----------------------------------------------------------------------
@router.get("/keys")
async def list_keys(request: Request) -> dict[str, Any]:
    return {"keys": request.app.state.api_keys.list()}


@router.post("/keys")
async def create_key(request: Request, body: KeyBody) -> dict[str, Any]:
    record, key = request.app.state.api_keys.create(body.name)
    log.info("created sub-key %s (%s)", record["id"], record["name"])
    return {**record, "key": key}


@router.delete("/keys/{key_id}")
async def delete_key(key_id: str, request: Request) -> dict[str, Any]:
    request.app.state.api_keys.delete(key_id)
    log.info("deleted sub-key %s", key_id)
    return {"id": key_id, "deleted": True}


# ----- model files -------------------------------------------------------------------
def deletable_root(info: Any, model_dir: Path, others: list[Any]) -> Path:
    """The resolved folder a delete of `info` removes: its own folder, strictly inside the model
    dir and holding no other discovered model; otherwise InvalidRequestError (nothing removed)."""
    root = Path(info.root).resolve()
    if root == model_dir or model_dir not in root.parents:
        raise InvalidRequestError(
            f"Model '{info.id}' lives at {root}, outside the model dir {model_dir}; delete it by hand.",
            param="model",
        )
    for other in others:
        if other.id == info.id:
            continue
        held = Path(other.root).resolve()
        if held == root or root in held.parents:
            raise InvalidRequestError(
                f"Model '{info.id}' shares its folder {root} with model '{other.id}'; delete it by hand.",
                param="model",
            )
    return root


@router.delete("/models/{model_id:path}/files")
async def delete_model_files(model_id: str, request: Request) -> dict[str, Any]:
    """Remove the named model's own folder (a hub-cache model: its `models--org--name` folder)."""
    pool = request.app.state.pool
    info = pool.resolve(model_id).info
    model_dir = Path(request.app.state.settings.model_dir).resolve()
    root = deletable_root(info, model_dir, list(pool.models().values()))
    if pool.state_of(info.id) == "serving":  # no entry held here: the unload's collection frees it
        raise ConflictError(f"Model '{info.id}' is serving requests; try again when they finish.")
    pool.unload(info.id)
    await asyncio.to_thread(shutil.rmtree, root)
    parent = root.parent
    if not root.name.startswith("models--") and parent.parent == model_dir and not any(parent.iterdir()):
        parent.rmdir()  # an org folder left empty
    pool.refresh()
    log.info("deleted the files of %s (%s)", info.id, root)
    return {"id": info.id, "deleted": True, "path": str(root)}
