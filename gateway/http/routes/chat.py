"""POST /v1/chat/completions"""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.core.errors import InvalidRequest, PermissionDenied
from gateway.core.outputs import ChatCompletion
from gateway.core.schemas import ChatCompletionRequest
from gateway.core.types import Principal, RouteOverride
from gateway.http.openapi import GENERATION, streamed
from gateway.http.sse import open_stream
from gateway.service.auth import require_principal
from gateway.service.chat import GatewayService

router = APIRouter(prefix="/v1", tags=["chat"])


async def service(request: Request) -> GatewayService:
    svc: GatewayService = request.app.state.service
    return svc


async def routing_override(
    request: Request,
    who: Annotated[Principal, Depends(require_principal)],
    svc: Annotated[GatewayService, Depends(service)],
) -> RouteOverride | None:
    """Admin headers for one request: ``x-vcache-routing`` forces a policy (comparisons),
    ``x-vcache-replica`` a replica (a load test's oracle placement)."""
    policy = request.headers.get("x-vcache-routing")
    replica = request.headers.get("x-vcache-replica")
    if policy is None and replica is None:
        return None
    if not who.admin:
        raise PermissionDenied(
            "x-vcache-routing and x-vcache-replica need an admin key", code="admin_required"
        )
    if policy is not None and policy not in svc.routing_policies:
        raise InvalidRequest(
            f"x-vcache-routing must be one of {', '.join(svc.routing_policies)}",
            param="x-vcache-routing",
            code="invalid_value",
        )
    return RouteOverride(policy=policy, replica=replica)


SESSION_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


async def session_header(request: Request) -> str | None:
    """``x-vcache-session``: append this request to that session of the log."""
    sid = request.headers.get("x-vcache-session")
    if sid is not None and not SESSION_ID.match(sid):
        raise InvalidRequest(
            "x-vcache-session must be 1-128 characters of letters, digits, '_', '.', ':' or '-'",
            param="x-vcache-session",
            code="invalid_value",
        )
    return sid


@router.post(
    "/chat/completions",
    response_model=None,
    responses={**streamed(ChatCompletion), **GENERATION},
)
async def create_chat_completion(
    body: ChatCompletionRequest,
    who: Annotated[Principal, Depends(require_principal)],
    svc: Annotated[GatewayService, Depends(service)],
    route: Annotated[RouteOverride | None, Depends(routing_override)],
    session: Annotated[str | None, Depends(session_header)],
) -> JSONResponse | StreamingResponse:
    if body.stream:
        routed = await svc.chat_stream(body, who, route, session)
        return await open_stream(routed.body, routed.headers())
    done = await svc.chat(body, who, route, session)
    return JSONResponse(done.body.model_dump(mode="json"), headers=done.headers())
