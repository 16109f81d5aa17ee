"""Errors and server-sent events in Anthropic's shape, for the Messages API routes.

Every error is ``{"type": "error", "error": {"type", "message"}, "request_id"}``
with Anthropic's status codes: overload (a full queue, an engine or provider
that cannot take the request now) is 529 ``overloaded_error``, a request too
large 413 ``request_too_large``, a timeout 504 ``timeout_error``, anything
else of the gateway's own 5xx ``api_error``.  Each response carries a
``request-id`` header, as Anthropic's do.
"""

from __future__ import annotations

import uuid

from fastapi import Request
from fastapi.responses import JSONResponse

from gateway.core.errors import APIError
from gateway.core.messages_wire import ErrorDetail, ErrorEvent
from gateway.service.limits import anthropic_headers

PREFIX = "/v1/messages"
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
_STATUS = {503: 529}  # Anthropic's overload status


def is_messages(request: Request) -> bool:
    return request.url.path.startswith(PREFIX)


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex[:24]}"


def request_id(request: Request) -> str:
    """This request's ``request-id`` (made once, kept on the request)."""
    rid: str | None = getattr(request.state, "anthropic_request_id", None)
    if rid is None:
        rid = request.state.anthropic_request_id = new_request_id()
    return rid


def error_event(exc: APIError, rid: str | None = None) -> tuple[int, ErrorEvent]:
    kind = _TYPES.get(exc.status, "api_error")
    return _STATUS.get(exc.status, exc.status), ErrorEvent(
        error=ErrorDetail(type=kind, message=exc.message), request_id=rid
    )


def error_response(exc: APIError, request: Request) -> JSONResponse:
    rid = request_id(request)
    status, body = error_event(exc, rid)
    headers = {**anthropic_headers(exc.headers()), "request-id": rid}
    return JSONResponse(body.model_dump(exclude_none=True), status_code=status, headers=headers)
