"""/openapi.json: behind the API key like /v1, and a schema of what the server really sends
(every body, 400 never 422, each route's error statuses in its dialect's error body)."""

from __future__ import annotations

import jsonschema
import pytest

from omlx.server.openapi import EXTRA, api_routes
from tests.admin.conftest import API_KEY

MAIN = {"Authorization": f"Bearer {API_KEY}"}
HAND_READ_BODIES = {  # the routes that once read their body with request.json()
    ("post", "/api/auth/login"): "LoginBody",
    ("put", "/api/settings"): "SettingsPatch",
    ("post", "/api/keys"): "KeyBody",
    ("put", "/api/models/{model_id}/settings"): "ModelSettingsPatch",
    ("post", "/api/models/{model_id}/profiles/{name}"): "ProfileBody",
    ("put", "/api/models/{model_id}/profiles/{name}"): "ProfileBody",
    ("post", "/api/downloads"): "DownloadBody",
    ("post", "/api/bench"): "BenchBody",
}
INFERENCE = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/v1/embeddings",
             "/v1/rerank", "/v2/rerank", "/rerank"]


@pytest.fixture()
def schema(in_process_app) -> dict:
    client, _ = in_process_app
    r = client.get("/openapi.json", headers=MAIN)
    assert r.status_code == 200
    return r.json()


def operations(schema: dict):
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            yield method, path, op


def test_openapi_needs_the_key_a_sub_key_or_a_session(in_process_app):
    client, _ = in_process_app
    assert client.get("/openapi.json").status_code == 401
    assert client.get("/openapi.json", headers={"x-api-key": "wrong"}).status_code == 401
    subkey = client.post("/api/keys", json={"name": "docs"}, headers=MAIN).json()["key"]
    assert client.get("/openapi.json", headers={"Authorization": f"Bearer {subkey}"}).status_code == 200
    assert client.post("/api/auth/login", json={"api_key": API_KEY}).status_code == 200
    assert client.get("/openapi.json").status_code == 200  # the session cookie the login set


def test_root_and_health_stay_public_and_say_little(in_process_app):
    client, _ = in_process_app
    root = client.get("/")
    assert root.status_code == 200 and set(root.json()) == {"name", "version"}
    assert client.head("/").status_code == 200
    assert client.get("/health").json() == {"status": "ok"}


def test_no_422_anywhere_and_validation_models_are_gone(schema):
    for method, path, op in operations(schema):
        assert "422" not in op["responses"], (method, path)
    assert not {"HTTPValidationError", "ValidationError"} & set(schema["components"]["schemas"])


def test_every_hand_read_body_is_documented(schema):
    for (method, path), model in HAND_READ_BODIES.items():
        body = schema["paths"][path][method]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}, (method, path)
        assert schema["components"]["schemas"][model]["properties"], model
    assert schema["components"]["schemas"]["BenchBody"]["required"] == ["model"]


def test_each_route_lists_its_error_statuses_in_its_dialect(schema):
    for method, path, op in operations(schema):
        responses = op["responses"]
        queries = [p for p in op.get("parameters", []) if p["in"] == "query"]
        if op.get("requestBody") or queries or method in ("post", "put", "delete"):
            assert "400" in responses, (method, path)
        if "{" in path:
            assert "404" in responses, (method, path)
        if path.startswith("/api/") and not path.startswith("/api/auth/"):
            assert {"401", "403"} <= set(responses), (method, path)
        if path.startswith("/v1/"):
            assert "401" in responses, (method, path)
        dialect = "AnthropicError" if path.startswith("/v1/messages") else "Error"
        for status, response in responses.items():
            if status.startswith("2") or path == "/health":
                continue
            ref = response["content"]["application/json"]["schema"]["$ref"]
            assert ref == f"#/components/schemas/{dialect}", (method, path, status)
    for path in INFERENCE:
        assert {"400", "401", "404", "413", "429"} <= set(schema["paths"][path]["post"]["responses"]), path
    assert "Retry-After" in schema["paths"]["/v1/chat/completions"]["post"]["responses"]["429"]["headers"]
    assert "409" in schema["paths"]["/api/models/{model_id}/files"]["delete"]["responses"]
    assert "429" in schema["paths"]["/api/auth/login"]["post"]["responses"]


def test_extra_statuses_name_served_routes_only(in_process_app):
    client, _ = in_process_app
    served = {(m, c.path) for c in api_routes(client.app) for m in c.methods}
    assert set(EXTRA) <= served


def test_the_error_schemas_match_the_bodies_sent(in_process_app, schema):
    client, _ = in_process_app
    components = schema["components"]["schemas"]
    openai = client.post("/v1/chat/completions", json={"messages": []}, headers=MAIN)
    anthropic = client.post("/v1/messages", json={"messages": []}, headers=MAIN)
    unauthorised = client.get("/api/system")
    assert openai.status_code == anthropic.status_code == 400 and unauthorised.status_code == 401
    jsonschema.validate(openai.json(), components["Error"])
    jsonschema.validate(unauthorised.json(), components["Error"])
    jsonschema.validate(anthropic.json(), components["AnthropicError"])


def test_streaming_routes_document_their_event_streams(schema):
    """What schemathesis checks responses against: a streamed answer's content type is documented."""
    from omlx.server.openapi import STREAMING

    assert {path for _method, path in STREAMING} == set(INFERENCE[:4])
    for method, path in STREAMING:
        content = schema["paths"][path][method.lower()]["responses"]["200"]["content"]
        assert {"application/json", "text/event-stream"} <= set(content)
