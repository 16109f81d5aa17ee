"""API errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

::

    APIError
    ├── InvalidRequest       400 invalid_request_error (names the parameter)
    ├── AuthenticationFailed 401 authentication_error
    ├── PermissionDenied     403 permission_error
    ├── NotFound             404 not_found_error
    ├── PayloadTooLarge      413 invalid_request_error
    ├── RateLimited          429 rate_limit_error (Retry-After)
    └── Unavailable          503 service_unavailable (Retry-After)

Engine errors are mapped here once (:func:`from_engine_error`); the HTTP
handlers (``gateway/http_errors.py``) and later the gRPC servicer render these.
"""

from __future__ import annotations

import math

from engines.errors import (
    EngineError,
    EngineGenerationFailed,
    EngineInputError,
    EngineOverloaded,
    EngineUnavailable,
)


class APIError(Exception):
    status = 500
    type = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class InvalidRequest(APIError):
    status = 400
    type = "invalid_request_error"


class AuthenticationFailed(APIError):
    status = 401
    type = "authentication_error"


class PermissionDenied(APIError):
    status = 403
    type = "permission_error"


class NotFound(APIError):
    status = 404
    type = "not_found_error"


class PayloadTooLarge(APIError):
    status = 413
    type = "invalid_request_error"


class RateLimited(APIError):
    status = 429
    type = "rate_limit_error"


class Unavailable(APIError):
    status = 503
    type = "service_unavailable"


def from_engine_error(exc: EngineError) -> APIError:
    if isinstance(exc, EngineInputError):
        return InvalidRequest(str(exc), param=exc.param, code="invalid_value")
    if isinstance(exc, EngineOverloaded):
        return Unavailable(str(exc), code="engine_overloaded", retry_after_s=exc.retry_after_s)
    if isinstance(exc, EngineGenerationFailed):
        return APIError(str(exc), code="generation_failed")
    if isinstance(exc, EngineUnavailable):
        return Unavailable(str(exc), code="engine_unavailable", retry_after_s=5)
    return APIError(f"engine error: {exc}")
