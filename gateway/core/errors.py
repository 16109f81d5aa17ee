"""API errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

::

    APIError
    ├── InvalidRequest       400 invalid_request_error (names the parameter)
    ├── AuthenticationFailed 401 authentication_error
    ├── PermissionDenied     403 permission_error
    ├── NotFound             404 not_found_error
    ├── RequestTimeout       408 invalid_request_error (the request did not arrive in time)
    ├── PayloadTooLarge      413 invalid_request_error
    ├── RateLimited          429 rate_limit_error (Retry-After)
    ├── BadGateway           502 upstream_error (a provider failed)
    ├── Unavailable          503 service_unavailable (Retry-After)
    └── GatewayTimeout       504 timeout_error (a provider did not answer in time)

Engine errors are mapped here once (:func:`from_engine_error`); the HTTP
handlers (``gateway/http/errors.py``) and later the gRPC servicer render these.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar

from engines.errors import (
    EngineError,
    EngineGenerationFailed,
    EngineInputError,
    EngineOverloaded,
    EngineUnavailable,
)
from engines.providers.errors import (
    ProviderAuthError,
    ProviderBadAnswer,
    ProviderBadRequest,
    ProviderError,
    ProviderNotFound,
    ProviderOverloaded,
    ProviderRateLimited,
    ProviderStreamCut,
    ProviderTimeout,
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
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self._headers = dict(headers or {})  # sent with the error (a 429's rate limits)

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
            return dict(self._headers)
        return {**self._headers, "Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


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


class RequestTimeout(APIError):
    status = 408
    type = "invalid_request_error"


class PayloadTooLarge(APIError):
    status = 413
    type = "invalid_request_error"


class RateLimited(APIError):
    status = 429
    type = "rate_limit_error"


class Unavailable(APIError):
    status = 503
    type = "service_unavailable"


class BadGateway(APIError):
    status = 502
    type = "upstream_error"


class GatewayTimeout(APIError):
    status = 504
    type = "timeout_error"


def from_provider_error(exc: ProviderError) -> APIError:
    """A provider's failure, as this gateway's client sees it (the key is never named)."""
    msg, after = str(exc), exc.retry_after_s
    if isinstance(exc, ProviderBadRequest):
        return InvalidRequest(msg, code="upstream_invalid_request")
    if isinstance(exc, ProviderRateLimited):
        return RateLimited(msg, code="upstream_rate_limited", retry_after_s=after or 1)
    if isinstance(exc, ProviderOverloaded):
        return Unavailable(msg, code="upstream_overloaded", retry_after_s=after or 1)
    if isinstance(exc, ProviderTimeout):
        return GatewayTimeout(msg, code="upstream_timeout")
    if isinstance(exc, ProviderBadAnswer):
        return BadGateway(msg, code="upstream_bad_answer")
    if isinstance(exc, ProviderStreamCut):
        return BadGateway(msg, code="upstream_stream_cut")
    if isinstance(exc, ProviderAuthError):
        return BadGateway(msg, code="upstream_auth_failed")
    if isinstance(exc, ProviderNotFound):
        return BadGateway(msg, code="upstream_not_found")
    return BadGateway(msg, code="upstream_unavailable")


def from_engine_error(exc: EngineError) -> APIError:
    if isinstance(exc, ProviderError):
        return from_provider_error(exc)
    if isinstance(exc, EngineInputError):
        return InvalidRequest(str(exc), param=exc.param, code="invalid_value")
    if isinstance(exc, EngineOverloaded):
        return Unavailable(str(exc), code="engine_overloaded", retry_after_s=exc.retry_after_s)
    if isinstance(exc, EngineGenerationFailed):
        return APIError(str(exc), code="generation_failed")
    if isinstance(exc, EngineUnavailable):
        return Unavailable(str(exc), code="engine_unavailable", retry_after_s=5)
    return APIError(f"engine error: {exc}")


P = ParamSpec("P")
R = TypeVar("R")


def maps_engine_errors(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """``fn`` with every engine error it lets out mapped once to the API's terms (a sick
    replica's control endpoint is a 503 with Retry-After, never a 500)."""

    @functools.wraps(fn)
    async def mapped(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return await fn(*args, **kwargs)
        except EngineError as exc:
            raise from_engine_error(exc) from exc

    return mapped


def _param_parts(loc: tuple[int | str, ...]) -> list[str]:
    """The field path without "body" and pydantic's union-branch tags ("str", "list[X]")."""
    return [
        p
        for p in (str(x) for x in loc if x != "body")
        if not ("[" in p or p in ("str", "int", "float", "bool") or p.startswith("constrained-"))
    ]


def _param(loc: tuple[int | str, ...]) -> str | None:
    parts = _param_parts(loc)
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


def invalid_request_from(errors: Sequence[Any]) -> InvalidRequest:
    """The first of pydantic's errors as a 400 naming the parameter (HTTP and gRPC alike)."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    # A union reports one error per branch: of those on the same field, the deepest names
    # the value that is wrong (stop[1], not stop), and a broken constraint says more than
    # another branch's wrong type.
    field = tuple(first.get("loc", ()))[:1]
    same = [e for e in errors if tuple(e.get("loc", ()))[:1] == field]

    def specific(e: Any) -> tuple[int, bool]:
        depth = len(_param_parts(tuple(e.get("loc", ()))))
        return depth, not str(e.get("type", "")).endswith("_type")

    first = max(same, key=specific, default=first)
    if first.get("type") == "json_invalid":
        return InvalidRequest("The request body is not valid JSON", code="invalid_json")
    loc = tuple(first.get("loc", ()))
    ctx: Any = first.get("ctx") or {}
    param = _param(loc) or ctx.get("param")
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None and first.get("type") == "missing":
        return InvalidRequest("The request body is missing", code="invalid_json")
    code = {
        "missing": "missing_required_parameter",
        "unsupported_parameter": "unsupported_parameter",
    }.get(str(first.get("type")), "invalid_value")
    named = param and code == "invalid_value"  # an unsupported one's message names it
    text = f"Invalid value for '{param}': {msg}" if named else msg
    if code == "missing_required_parameter":
        text = f"Missing required parameter: '{param}'"
    return InvalidRequest(text, param=param, code=code)
