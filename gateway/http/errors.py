"""Exception handlers that render every error in OpenAI's shape.

A client mistake is always a 4xx naming the parameter; only a real bug in the
gateway is a 500, and its body says nothing about internals.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.core.errors import APIError, InvalidRequest, NotFound
from gateway.core.metrics import Metrics

log = logging.getLogger(__name__)


def error_response(exc: APIError, metrics: Metrics | None = None) -> JSONResponse:
    if metrics is not None:
        metrics.errors.labels(exc.type).inc()
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


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


def validation_error(exc: RequestValidationError) -> InvalidRequest:
    return invalid_request_from(exc.errors())


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
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_value"
    text = f"Invalid value for '{param}': {msg}" if param else msg
    if code == "missing_required_parameter":
        text = f"Missing required parameter: '{param}'"
    return InvalidRequest(text, param=param, code=code)


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return error_response(exc, metrics)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc), metrics)

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            err: APIError = NotFound(f"Unknown path: {request.url.path}", code="unknown_url")
        else:
            err = APIError(str(exc.detail))
            err.status = exc.status_code
            err.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(err, metrics)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(APIError("The server had an error processing your request"), metrics)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
