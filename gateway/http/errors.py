"""Exception handlers that render every error in OpenAI's shape (Anthropic's on the
Messages API routes, :mod:`gateway.http.anthropic`).

A client mistake is always a 4xx naming the parameter; only a real bug in the
gateway is a 500, and its body says nothing about internals.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.core.errors import APIError, InvalidRequest, NotFound, invalid_request_from
from gateway.core.metrics import Metrics
from gateway.http import anthropic

log = logging.getLogger(__name__)


def error_response(
    exc: APIError, metrics: Metrics | None = None, request: Request | None = None
) -> Response:
    if metrics is not None:
        metrics.errors.labels(exc.type).inc()
    if request is not None and anthropic.is_messages(request):
        return anthropic.error_response(exc, request)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())


def validation_error(exc: RequestValidationError) -> InvalidRequest:
    return invalid_request_from(exc.errors())


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return error_response(exc, metrics, request)

    async def on_validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc), metrics, request)

    async def on_http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404:
            err: APIError = NotFound(f"Unknown path: {request.url.path}", code="unknown_url")
        else:
            err = APIError(str(exc.detail))
            err.status = exc.status_code
            err.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(err, metrics, request)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path)
        err = APIError("The server had an error processing your request")
        return error_response(err, metrics, request)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
