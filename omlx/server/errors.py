"""Render errors in the caller's API dialect (OpenAI or Anthropic).

Every failure reaching HTTP goes through here, so a client always gets its own
error shape, a 4xx for its mistakes and a 5xx only for ours.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from omlx.errors import OMLXError
from omlx.server.disconnect import ClientDisconnected, client_closed_response

log = logging.getLogger("omlx.server")

ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    507: "api_error",
}


def is_anthropic(request: Request) -> bool:
    return request.url.path.startswith("/v1/messages")


def error_response(
    request: Request,
    status: int,
    message: str,
    *,
    error_type: str | None = None,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    if is_anthropic(request):
        body = {
            "type": "error",
            "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message},
        }
    else:
        body = {
            "error": {
                "message": message,
                "type": error_type or ("invalid_request_error" if status < 500 else "server_error"),
                "param": param,
                "code": code,
            }
        }
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request body.", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"Malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "missing":
        return f"Missing required parameter '{param}'.", param
    msg = first.get("msg", "invalid value")
    return (f"Invalid value for '{param}': {msg}." if param else f"Invalid request body: {msg}."), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OMLXError)
    async def _omlx(request: Request, exc: OMLXError) -> JSONResponse:
        headers = None
        retry_after = getattr(exc, "retry_after", None)  # OverloadedError's, a 503's over the memory limit
        if retry_after is not None:
            headers = {"Retry-After": str(retry_after)}
        if exc.status >= 500:  # ours; one to retry (Retry-After) is a state, not a fault
            level = logging.WARNING if retry_after is not None else logging.ERROR
            log.log(level, "%s %s failed: %s", request.method, request.url.path, exc.message)
        return error_response(
            request, exc.status, exc.message, error_type=exc.error_type, param=exc.param,
            code=exc.code, headers=headers,
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(request, 400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else "HTTP error"
        if exc.status_code == 404 and message == "Not Found":
            message = f"No route {request.method} {request.url.path}."
        if exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}."
        return error_response(request, exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        log.info("%s %s: the client went before the answer was ready; its work was cancelled",
                 request.method, request.url.path)
        return client_closed_response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(request, 500, f"Internal server error: {type(exc).__name__}")
