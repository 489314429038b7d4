"""Auth, checked by walking every route of the app (in process, API key set, nothing loaded).

Public routes are the allow-list below: a route added without auth fails here. Requests that
get past auth carry bodies that fail validation or name unknown objects, so nothing is loaded,
downloaded, benchmarked or deleted; only whether the answer is 401/403 matters.
"""

from __future__ import annotations

import re

import pytest
from fastapi.routing import APIRoute, iter_route_contexts
from starlette.routing import Mount

from tests.admin.conftest import API_KEY

PUBLIC = {
    ("GET", "/health"), ("GET", "/"), ("HEAD", "/"),
    ("GET", "/admin"), ("GET", "/admin/"),
    ("GET", "/api/auth/session"), ("POST", "/api/auth/login"), ("POST", "/api/auth/logout"),
}
PUBLIC_MOUNTS = {"/admin/static"}
WITH_BODY = ("POST", "PUT", "PATCH", "DELETE")
MAIN = {"Authorization": f"Bearer {API_KEY}"}
# Values that fail validation before the route asks the hub for anything.
PARAMS = {"repo_id": "no..repo"}
QUERIES = {"/api/hub/search": "?limit=0"}


def served_routes(app) -> list[tuple[str, str]]:
    """(method, path) of every APIRoute the app serves, /openapi.json included."""
    found = []
    for context in iter_route_contexts(app.routes):
        route = context.original_route
        if isinstance(route, Mount):
            assert context.path in PUBLIC_MOUNTS, f"unexpected mount {context.path}"
            continue
        assert isinstance(route, APIRoute), f"{context.path}: not an APIRoute, so not walked here"
        found += [(method, context.path) for method in sorted(context.methods)]
    return found


def concrete(path: str) -> str:
    """The route's path with every parameter filled by a name that exists nowhere (or is invalid)."""
    filled = re.sub(r"\{(\w+)(:\w+)?\}", lambda m: PARAMS.get(m.group(1), "nothing-here"), path)
    return filled + QUERIES.get(path, "")


def call(client, method: str, path: str, headers: dict[str, str] | None = None) -> int:
    body = {"content": b"[]", "headers": {"content-type": "application/json", **(headers or {})}}
    if method not in WITH_BODY:
        body = {"headers": headers or {}}
    return client.request(method, concrete(path), **body).status_code


@pytest.fixture()
def walked(in_process_app):
    client, _models = in_process_app
    r = client.post("/api/keys", json={"name": "walker"}, headers=MAIN)
    assert r.status_code == 200, r.text
    routes = served_routes(client.app)
    assert len(routes) > 40 and ("GET", "/openapi.json") in routes
    return client, routes, r.json()["key"]


def test_the_public_allow_list_names_served_routes_only(walked):
    client, routes, _ = walked
    assert PUBLIC <= set(routes)
    for method, path in PUBLIC:
        assert call(client, method, path) not in (401, 403), (method, path)
    assert client.get("/admin/static/core.js").status_code == 200


def test_every_other_route_needs_a_key_and_sub_keys_only_open_inference(walked):
    client, routes, subkey = walked
    guarded = [(m, p) for m, p in routes if (m, p) not in PUBLIC]
    for method, path in guarded:
        where = f"{method} {path}"
        assert call(client, method, path) == 401, where
        assert call(client, method, path, {"Authorization": "Bearer wrong"}) == 401, where
        assert call(client, method, path, {"x-api-key": "wrong"}) == 401, where
        as_subkey = call(client, method, path, {"x-api-key": subkey})
        if path.startswith("/api/"):
            assert as_subkey == 403, where
        else:  # /v1, /v2/rerank, /rerank, /openapi.json
            assert as_subkey not in (401, 403), where
        assert call(client, method, path, MAIN) not in (401, 403), where
    assert {p for _, p in guarded if not p.startswith("/api/")} >= {"/openapi.json", "/v1/chat/completions"}


def test_metrics_public_opens_only_metrics(omlx_home, tmp_path):
    from fastapi.testclient import TestClient

    from omlx.server.app import create_app
    from omlx.settings import load_settings

    settings = load_settings({"model_dir": str(tmp_path), "api_key": API_KEY, "no_cache": True,
                              "metrics_public": True})
    app = create_app(settings)
    with TestClient(app, base_url="http://localhost") as client:
        scraped = client.get("/metrics")
        assert scraped.status_code == 200 and "omlx_process_memory_bytes" in scraped.text
        assert client.get("/v1/models").status_code == 401
