"""A small exception hierarchy; the HTTP layer maps each class to one status code.

Every API dialect renders these in its own error format, so engine and pool code
raise these and never build HTTP responses themselves.
"""

from __future__ import annotations


class OMLXError(Exception):
    """Base class. `status` is the HTTP status; `param` names the offending field."""

    status: int = 500
    error_type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(OMLXError):
    """The caller sent something we cannot serve as asked (400)."""

    status = 400
    error_type = "invalid_request_error"


class AuthenticationError(OMLXError):
    status = 401
    error_type = "authentication_error"


class ModelNotFoundError(OMLXError):
    status = 404
    error_type = "not_found_error"

    def __init__(self, model: str, available: list[str] | None = None):
        hint = f" Available models: {', '.join(available)}." if available else ""
        super().__init__(
            f"The model '{model}' does not exist.{hint}", param="model", code="model_not_found"
        )


class PermissionDeniedError(OMLXError):
    """Authenticated, but this credential may not do this (403)."""

    status = 403
    error_type = "permission_error"


class ConflictError(OMLXError):
    """The request conflicts with the current state, e.g. a task already running (409)."""

    status = 409
    error_type = "conflict_error"


class UpstreamError(OMLXError):
    """A service we depend on (the model hub) failed or could not be reached (502)."""

    status = 502
    error_type = "upstream_error"


class NotFoundError(OMLXError):
    status = 404
    error_type = "not_found_error"


class OverloadedError(OMLXError):
    """The waiting queue is full; the client should retry after `retry_after` seconds."""

    status = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, retry_after: int = 1):
        super().__init__(message, code="server_overloaded")
        self.retry_after = retry_after


class ServiceUnavailableError(OMLXError):
    """The server cannot take this request now (shutting down, over its memory limit): retry
    elsewhere or later, after `retry_after` seconds where given (503)."""

    status = 503
    error_type = "server_error"

    def __init__(self, message: str, retry_after: int | None = None, code: str = "unavailable"):
        super().__init__(message, code=code)
        self.retry_after = retry_after


class ModelLoadError(OMLXError):
    """The named model's folder could not be loaded (its config, weights or tokenizer): the
    model is unavailable, the server is not at fault and serves the others (503)."""

    status = 503
    error_type = "server_error"

    def __init__(self, model: str, reason: BaseException):
        detail = (str(reason).strip().splitlines() or [""])[0][:500]
        super().__init__(
            f"Model '{model}' could not be loaded: {type(reason).__name__}"
            + (f": {detail}" if detail else "")
            + ". Check its folder (config.json, weights, tokenizer); the other models keep serving.",
            param="model",
            code="model_load_failed",
        )


class InsufficientMemoryError(OMLXError):
    status = 507
    error_type = "insufficient_memory_error"


class EngineError(OMLXError):
    """Our fault: the engine failed while serving a request (500)."""

    status = 500
    error_type = "server_error"


class ConfigError(Exception):
    """Bad settings or environment at start-up: printed as one line, exit code 2."""
