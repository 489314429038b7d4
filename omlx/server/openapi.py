"""The OpenAPI schema as the server behaves, served at `/openapi.json` behind the API key.

FastAPI's generated schema documents a 422 that this server never sends (validation errors
are 400, `server/errors.py`) and none of the errors it does send. Here every operation's 422
becomes a 400 and each operation lists the error statuses it can send, with the error body of
its dialect: OpenAI's `{"error": {...}}`, or Anthropic's `{"type": "error", ...}` on
`/v1/messages`; the streaming routes' 200 also lists `text/event-stream`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.dependencies.models import Dependant
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute, RouteContext, iter_route_contexts

from omlx.server.auth import SAFE_METHODS, require_admin, require_api_key
from omlx.server.body_limits import MAX_BODY_BYTES

OPENAPI_PATH = "/openapi.json"
WITH_BODY = ("POST", "PUT", "PATCH", "DELETE")  # the methods whose bodies `BodyLimits` checks

ERROR_SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "description": "An error in the OpenAI dialect (every route but /v1/messages).",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string", "examples": ["invalid_request_error"]},
                    "param": {"type": ["string", "null"], "description": "The field at fault"},
                    "code": {"type": ["string", "null"], "examples": ["model_not_found"]},
                },
            }
        },
    },
    "AnthropicError": {
        "type": "object",
        "description": "An error in the Anthropic dialect (/v1/messages routes).",
        "required": ["type", "error"],
        "properties": {
            "type": {"const": "error"},
            "error": {
                "type": "object",
                "required": ["type", "message"],
                "properties": {
                    "type": {"type": "string", "examples": ["invalid_request_error"]},
                    "message": {"type": "string"},
                },
            },
        },
    },
}

STATUS_TEXT = {
    400: "Invalid request: a malformed, over-nested or invalid body or parameter (never 422)",
    401: "Missing or invalid API key (when the server has one)",
    403: "Not allowed with this credential: a sub-key on the admin API, a dashboard session's "
         "state change without the X-OMLX-Admin header, or a cross-origin browser request",
    404: "No such model or object",
    409: "Conflicts with what is running now",
    413: f"The body is larger than {MAX_BODY_BYTES >> 20} MiB",
    429: "Overloaded: retry after the Retry-After header's seconds",
    500: "The engine failed while serving the request",
    502: "The model hub or an MCP server failed or could not be reached",
    503: "The server is shutting down, lost its GPU, or is over its process memory limit "
         "(then with Retry-After); retry shortly",
    504: "The MCP tool did not answer within --mcp-tool-timeout",
    507: "Not enough memory to load the model",
}

INFERENCE = {
    ("POST", path)
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses",
                 "/v1/embeddings", "/v1/rerank", "/v2/rerank", "/rerank")
}
# Statuses a route sends that its parameters and auth do not tell: (method, route path) → statuses.
EXTRA: dict[tuple[str, str], set[int]] = {
    **{route: {404, 429, 500, 503, 507} for route in INFERENCE},
    ("POST", "/v1/messages/count_tokens"): {404, 503, 507},
    ("POST", "/api/cache/explain"): {404, 503, 507},
    ("POST", "/v1/models/{model_id:path}/load"): {503, 507},
    ("DELETE", "/api/models/{model_id:path}/files"): {409},
    ("POST", "/api/bench"): {404, 409},
    ("POST", "/api/bench/cancel"): {409},
    ("POST", "/api/downloads"): {409},
    ("POST", "/api/downloads/{job_id}/cancel"): {409},
    ("POST", "/api/downloads/{job_id}/retry"): {409},
    ("DELETE", "/api/downloads/{job_id}"): {409},
    ("GET", "/api/hub/search"): {502},
    ("GET", "/api/hub/models/{repo_id:path}"): {502},
    ("POST", "/api/auth/login"): {401, 403, 429},
    ("POST", "/api/auth/logout"): {403},
    ("POST", "/v1/mcp/execute"): {404, 502, 503, 504},
}


def _calls(dependant: Dependant) -> set[Callable[..., Any]]:
    """Every dependency callable of a route, however deeply nested."""
    found: set[Callable[..., Any]] = set()
    for dep in dependant.dependencies:
        if dep.call is not None:
            found.add(dep.call)
        found |= _calls(dep)
    return found


def api_routes(app: FastAPI) -> list[RouteContext]:
    """Every APIRoute of the app as served (prefixes and router dependencies applied)."""
    return [c for c in iter_route_contexts(app.routes) if isinstance(c.original_route, APIRoute)]


def error_statuses(route: RouteContext, method: str) -> list[int]:
    """The error statuses `method` on `route` can send."""
    statuses = set(EXTRA.get((method, route.path), set()))
    dep = route.dependant
    if method in WITH_BODY:
        statuses |= {400, 413}  # BodyLimits: over-nested JSON, oversized bodies
    if dep.body_params or dep.query_params:
        statuses.add(400)
    if dep.path_params:  # a model, response, key, profile or download named in the path
        statuses.add(404)
    calls = _calls(dep)
    if require_admin in calls:
        statuses |= {401, 403}
    elif require_api_key in calls:
        statuses |= {401} if method in SAFE_METHODS else {401, 403}
    return sorted(statuses)


def _error_response(status: int, schema: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "description": STATUS_TEXT[status],
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
    }
    if status == 429:
        out["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait"}}
    return out


def _document_errors(operation: dict[str, Any], statuses: list[int], schema: str) -> None:
    """Drop the operation's 422; add each of `statuses` with the `schema` error body."""
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    for status in statuses:
        responses[str(status)] = _error_response(status, schema)


# Routes that answer `"stream": true` with server-sent events: (method, path) → what the events are.
STREAMING: dict[tuple[str, str], str] = {
    ("POST", "/v1/chat/completions"): "`chat.completion.chunk` objects as `data:` lines, then `data: [DONE]`",
    ("POST", "/v1/completions"): "`text_completion` chunks as `data:` lines, then `data: [DONE]`",
    ("POST", "/v1/messages"): "Anthropic events (`message_start` … `message_stop`, `ping`) as `event:` + `data:`",
    ("POST", "/v1/responses"): "Responses events (`response.created` … `response.completed`) as `event:` + `data:`",
}


def _document_stream(operation: dict[str, Any], events: str) -> None:
    """The 200 of a streaming route also answers `text/event-stream` (with `"stream": true`)."""
    ok = operation.setdefault("responses", {}).setdefault("200", {"description": "Successful Response"})
    ok.setdefault("content", {})["text/event-stream"] = {
        "schema": {"type": "string", "description": f'With "stream": true: {events}; comment lines '
                   "(`: keep-alive`) while the prompt is prefilled."},
    }  # fmt: skip


def _drop_validation_schemas(schema: dict[str, Any]) -> None:
    """FastAPI's 422 body models, referenced by nothing once every 422 is gone."""
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)


def _health_errors(schema: dict[str, Any]) -> None:
    """/health's 503 has a body of its own, not an error body."""
    op = schema["paths"].get("/health", {}).get("get")
    if op is not None:
        op["responses"]["503"] = {
            "description": "The GPU failed; the server is shutting down to be restarted",
            "content": {"application/json": {"schema": {
                "type": "object",
                "properties": {"status": {"const": "unhealthy"}, "reason": {"type": "string"}},
            }}},
        }


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI schema: 400 instead of 422, and every operation's error statuses."""
    schema = get_openapi(
        title=app.title, version=app.version, openapi_version=app.openapi_version,
        description=app.description, routes=app.routes,
        separate_input_output_schemas=app.separate_input_output_schemas,
    )
    schema.setdefault("components", {}).setdefault("schemas", {}).update(ERROR_SCHEMAS)
    for route in api_routes(app):
        if not route.include_in_schema:
            continue
        path = schema["paths"].get(route.path_format, {})
        dialect = "AnthropicError" if route.path.startswith("/v1/messages") else "Error"
        for method in route.methods:
            operation = path.get(method.lower())
            if operation is not None:
                _document_errors(operation, error_statuses(route, method), dialect)
                if (method, route.path) in STREAMING:
                    _document_stream(operation, STREAMING[(method, route.path)])
    _drop_validation_schemas(schema)
    _health_errors(schema)
    return schema


def install_openapi(app: FastAPI) -> None:
    """Serve `build_openapi(app)` at /openapi.json to callers of the inference API (key,
    sub-key or dashboard session). Build the app with `openapi_url=None`."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # FastAPI's documented hook for a customised schema

    @app.get(OPENAPI_PATH, include_in_schema=False, dependencies=[Depends(require_api_key)])
    async def openapi_json() -> JSONResponse:
        return JSONResponse(app.openapi())
