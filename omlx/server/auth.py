"""API-key check for /v1 routes: `Authorization: Bearer KEY` or `x-api-key: KEY`."""

from __future__ import annotations

import hmac

from fastapi import Request

from omlx.errors import AuthenticationError


def presented_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key")


def key_matches(presented: str | None, expected: str) -> bool:
    """Constant-time comparison; never log either value."""
    if presented is None:
        return False
    return hmac.compare_digest(presented.encode(), expected.encode())


async def require_api_key(request: Request) -> None:
    expected = request.app.state.settings.api_key
    if not expected:
        return
    if not key_matches(presented_key(request), expected):
        raise AuthenticationError(
            "Missing or invalid API key. Send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
            code="invalid_api_key",
        )
