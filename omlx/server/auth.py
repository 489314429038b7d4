"""Who may call what.

- `/v1` (inference): the API key, a sub-key, or a dashboard session.
- `/api` (admin): the API key or a dashboard session; sub-keys are inference-only (403).

Keys come as `Authorization: Bearer KEY` or `x-api-key: KEY`; the dashboard session is a
signed HttpOnly cookie. A cookie-authenticated request that changes state must also carry
the `X-OMLX-Admin` header (a cross-site page cannot set it without a CORS preflight, which
this server never grants), and any browser request to `/api` whose `Origin` is another
host is refused. With no API key set, everything is open, as the server then binds
loopback by default.
"""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from fastapi import Request

from omlx.errors import AuthenticationError, PermissionDeniedError

SESSION_COOKIE = "omlx_session"
CSRF_HEADER = "x-omlx-admin"
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")


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


def _is_subkey(request: Request, key: str) -> bool:
    store = getattr(request.app.state, "api_keys", None)
    return store is not None and store.verify(key)


def has_session(request: Request) -> bool:
    signer = getattr(request.app.state, "sessions", None)
    return signer is not None and signer.verify(request.cookies.get(SESSION_COOKIE))


def check_origin(request: Request) -> None:
    """Refuse state changes that a page on another host sent from a browser."""
    origin = request.headers.get("origin")
    if request.method in SAFE_METHODS or not origin:
        return
    if origin == "null" or urlsplit(origin).netloc.lower() != request.headers.get("host", "").lower():
        raise PermissionDeniedError(
            "Cross-origin request refused: the admin API only accepts requests from its own pages.",
            code="cross_origin",
        )


def _session_allows(request: Request) -> bool:
    if not has_session(request):
        return False
    if request.method not in SAFE_METHODS:
        check_origin(request)
        if request.headers.get(CSRF_HEADER) != "1":
            raise PermissionDeniedError(
                f"Dashboard requests that change state must send the '{CSRF_HEADER}: 1' header.",
                code="csrf",
            )
    return True


def _missing(what: str) -> AuthenticationError:
    return AuthenticationError(
        f"Missing or invalid API key. Send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'{what}.",
        code="invalid_api_key",
    )


async def require_api_key(request: Request) -> None:
    """Inference routes: the API key, a sub-key, or a dashboard session."""
    expected = request.app.state.settings.api_key
    if not expected:
        return
    key = presented_key(request)
    if key is not None:
        if key_matches(key, expected) or _is_subkey(request, key):
            return
        raise _missing("")
    if _session_allows(request):
        return
    raise _missing("")


async def require_admin(request: Request) -> None:
    """Admin routes: the API key or a dashboard session; sub-keys are refused."""
    check_origin(request)
    expected = request.app.state.settings.api_key
    if not expected:
        return
    key = presented_key(request)
    if key is not None:
        if key_matches(key, expected):
            return
        if _is_subkey(request, key):
            raise PermissionDeniedError(
                "This key is an inference-only sub-key; the admin API needs the main API key.",
                code="subkey_not_allowed",
            )
        raise _missing(", or log in at /admin")
    if _session_allows(request):
        return
    raise _missing(", or log in at /admin")
