"""FastAPI dependencies the routes share: the service, who calls, an admin's routing
override, the session header, a body read by hand, and whole answers serialized in one
pass."""

from __future__ import annotations

import email.message
import json
import re
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from gateway.core.errors import InvalidRequest, PermissionDenied
from gateway.core.types import Principal, RouteOverride
from gateway.service.auth import require_principal
from gateway.service.chat import GatewayService

M = TypeVar("M", bound=BaseModel)


async def json_object(request: Request) -> dict[str, Any]:
    """The body of a route that takes more than one model's shape: a JSON object (else a
    400 in the API's error format)."""
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object", code="invalid_value")
    return body


def _is_json(content_type: str | None) -> bool:
    """FastAPI's test (strict content type): ``application/json`` or ``application/*+json``."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


async def body_value(request: Request) -> Any:
    """The body as FastAPI reads a route's one body parameter, before its dependencies
    (for :mod:`gateway.http.direct`'s routes): parsed JSON when the content type says so
    (a decoding error raised now; any other failure to parse, such as bytes that are not
    UTF-8 or nesting too deep, FastAPI's 400), else the bytes (which no model takes), None
    when empty; :func:`validated_body` validates it after the dependencies."""
    raw = await request.body()
    if not raw:
        return None
    if not _is_json(request.headers.get("content-type")):
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        error = {
            "type": "json_invalid",
            "loc": ("body", e.pos),
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": e.msg},
        }
        raise RequestValidationError([error], body=e.doc) from e
    except Exception as e:
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from e


def validated_body(model: type[M], value: Any) -> M:
    """``value`` (:func:`body_value`) as ``model``, validated as FastAPI validates a body
    parameter; each error located under ``body``, raised as the
    :class:`RequestValidationError` the app's handler renders."""
    if value is None:
        missing = {"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}
        raise RequestValidationError([missing])
    try:
        return model.model_validate(value, from_attributes=True)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors, body=value) from exc


async def service(request: Request) -> GatewayService:
    svc: GatewayService = request.app.state.service
    return svc


def routing_override(request: Request, who: Principal, svc: GatewayService) -> RouteOverride | None:
    """Admin headers for one request: ``x-vcache-routing`` forces a policy (comparisons),
    ``x-vcache-replica`` a replica (a load test's oracle placement)."""
    policy = request.headers.get("x-vcache-routing")
    replica = request.headers.get("x-vcache-replica")
    if policy is None and replica is None:
        return None
    if not who.admin:
        raise PermissionDenied(
            "x-vcache-routing and x-vcache-replica need an admin key: configure one with "
            "'admin: true' in api_keys and send it as 'Authorization: Bearer KEY'",
            code="admin_required",
        )
    if policy is not None and policy not in svc.routing_policies:
        raise InvalidRequest(
            f"x-vcache-routing must be one of {', '.join(svc.routing_policies)}",
            param="x-vcache-routing",
            code="invalid_value",
        )
    return RouteOverride(policy=policy, replica=replica)


@dataclass(frozen=True)
class Caller:
    """Who calls, the service, and their routing override, as one dependency of the
    generation routes (FastAPI solves each dependency, and each of its own, per request)."""

    who: Principal
    svc: GatewayService
    route: RouteOverride | None


async def caller(request: Request) -> Caller:
    who = await require_principal(request)
    svc = await service(request)
    return Caller(who, svc, routing_override(request, who, svc))


def whole(body: BaseModel, headers: dict[str, str]) -> Response:
    """A whole (non-streamed) answer, serialized by pydantic in one pass."""
    return Response(body.model_dump_json(), media_type="application/json", headers=headers)


SESSION_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


# the coding agents' own session ids: Claude Code's, Codex's (session and thread), others'
AGENT_SESSION_HEADERS = (
    "x-claude-code-session-id",
    "session-id",
    "thread-id",
    "x-codex-window-id",
    "x-session-id",
)


async def session_header(request: Request) -> str | None:
    """The session to append this request to: ``x-vcache-session`` (a bad value is a 400),
    else an agent's own session header (ignored when it is not a valid name)."""
    sid = request.headers.get("x-vcache-session")
    if sid is not None and not SESSION_ID.match(sid):
        raise InvalidRequest(
            "x-vcache-session must be 1-128 characters of letters, digits, '_', '.', ':' or '-'",
            param="x-vcache-session",
            code="invalid_value",
        )
    if sid is not None:
        return sid
    for name in AGENT_SESSION_HEADERS:
        agent = request.headers.get(name)
        if agent and SESSION_ID.match(agent):
            return agent
    return None
