"""Admin JSON API for models: per-model settings, profiles, discovery refresh, cache."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from omlx.admin.bodies import ModelSettingsPatch, ProfileBody, RenameBody, as_sent

router = APIRouter(prefix="/api")


def _pool(request: Request) -> Any:
    return request.app.state.pool


def _model_id(request: Request, model_id: str) -> str:
    pool = _pool(request)
    return pool.resolve(model_id).info.id


@router.get("/models/{model_id:path}/settings")
async def get_model_settings(model_id: str, request: Request) -> dict[str, Any]:
    mid = _model_id(request, model_id)
    return {"id": mid, "settings": _pool(request).model_settings.get(mid).model_dump()}


@router.put("/models/{model_id:path}/settings")
async def put_model_settings(model_id: str, request: Request, body: ModelSettingsPatch) -> dict[str, Any]:
    mid = _model_id(request, model_id)
    patch = as_sent(body)
    patch.pop("profiles", None)  # profiles have their own routes
    updated = _pool(request).model_settings.update(mid, patch)
    return {"id": mid, "settings": updated.model_dump()}


@router.post("/models/{model_id:path}/profiles/{name}")
async def create_profile(model_id: str, name: str, request: Request, body: ProfileBody) -> dict[str, Any]:
    mid = _model_id(request, model_id)
    updated = _pool(request).model_settings.set_profile(mid, name, as_sent(body), create=True)
    return {"id": mid, "profile": name, "settings": updated.profiles[name].model_dump()}


@router.put("/models/{model_id:path}/profiles/{name}")
async def replace_profile(model_id: str, name: str, request: Request, body: ProfileBody) -> dict[str, Any]:
    mid = _model_id(request, model_id)
    updated = _pool(request).model_settings.set_profile(mid, name, as_sent(body), create=False)
    return {"id": mid, "profile": name, "settings": updated.profiles[name].model_dump()}


@router.post("/models/{model_id:path}/profiles/{name}/rename")
async def rename_profile(model_id: str, name: str, request: Request, body: RenameBody) -> dict[str, Any]:
    mid = _model_id(request, model_id)
    new = as_sent(body).get("to")
    updated = _pool(request).model_settings.rename_profile(mid, name, new)
    return {"id": mid, "profile": new, "settings": updated.profiles[new].model_dump()}


@router.delete("/models/{model_id:path}/profiles/{name}")
async def delete_profile(model_id: str, name: str, request: Request) -> dict[str, Any]:
    mid = _model_id(request, model_id)
    _pool(request).model_settings.delete_profile(mid, name)
    return {"id": mid, "profile": name, "deleted": True}


@router.post("/models/refresh")
async def refresh_models(request: Request) -> dict[str, Any]:
    found = _pool(request).refresh()
    return {
        "models": sorted(found.models),
        "problems": [{"path": str(p.path), "reason": p.reason} for p in found.problems],
    }


@router.get("/cache/stats")
async def cache_stats(request: Request) -> dict[str, Any]:
    c = request.app.state.cache
    return {"enabled": False} if c is None else {"enabled": True, **c.stats()}


@router.post("/cache/clear")
async def cache_clear(request: Request) -> dict[str, Any]:
    c = request.app.state.cache
    if c is not None:
        c.clear()
    return {"cleared": c is not None}
