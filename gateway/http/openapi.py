"""The OpenAPI document describes the API as it really answers.

- every route lists the errors it can return, in the API's own shape
  (``{"error": {...}}``), and FastAPI's default 422 (which this gateway never
  sends: validation errors are 400) is removed;
- bearer authentication is declared and required on ``/v1`` routes;
- streamed routes document ``text/event-stream`` beside their JSON body.

So a contract tester (schemathesis) can check every response against it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from gateway.core.messages_wire import ErrorEvent


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error, HTTP status aside: OpenAI's shape."""

    error: ErrorDetail


_WHY = {
    400: "Invalid request: the error names the parameter",
    401: "Missing or wrong API key",
    403: "The key may not do this (an admin or global admin key is needed)",
    404: "Unknown model, response, replica or path",
    408: "The request did not arrive in time",
    413: "The request body is too large",
    429: "Rate limited (a provider's); see Retry-After",
    502: "A hosted provider failed or answered what cannot be read",
    503: "Overloaded, starting, or the engine is restarting; see Retry-After",
    504: "A hosted provider did not answer in time",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for these error statuses."""
    return {c: {"model": ErrorResponse, "description": _WHY[c]} for c in codes}


_WHY_ANTHROPIC = {
    **_WHY,
    500: "The gateway or a hosted provider failed (api_error)",
    529: "Overloaded, starting, or the engine is restarting; see Retry-After",
}


def anthropic_errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries of the Messages API routes: Anthropic's error shape."""
    return {c: {"model": ErrorEvent, "description": _WHY_ANTHROPIC[c]} for c in codes}


# What any authenticated route may answer besides its own errors.
COMMON = (400, 401, 408, 413, 503)
GENERATION = errors(*COMMON, 403, 404, 429, 502, 504)


# one server-sent event, as contract testers read a stream (each event apart)
SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}


def streamed(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A 200 that is ``model`` as JSON, or server-sent events when ``stream`` is true."""
    sse = {"text/event-stream": {"schema": SSE_EVENT}}
    return {200: {"model": model, "content": sse, "description": "JSON, or SSE with stream"}}


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = get_openapi(
            title=app.title, version=app.version, routes=app.routes, description=__doc__
        )
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        doc["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer", "description": "an API key"},
            "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
        }
        for path, ops in doc.get("paths", {}).items():
            for op in ops.values():
                op.get("responses", {}).pop("422", None)
                if path.startswith("/v1/messages"):  # Anthropic's clients send x-api-key
                    op["security"] = [{"x-api-key": []}, {"bearer": []}]
                elif path.startswith("/v1/"):
                    op["security"] = [{"bearer": []}]
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
