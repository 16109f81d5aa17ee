"""POST /v1/chat/completions"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.auth import require_principal
from gateway.errors import InvalidRequest, PermissionDenied
from gateway.replicas import POLICIES, RoutingPolicy
from gateway.routers.sse import open_stream
from gateway.schemas import ChatCompletionRequest
from gateway.service import GatewayService, Principal

router = APIRouter(prefix="/v1", tags=["chat"])


def service(request: Request) -> GatewayService:
    svc: GatewayService = request.app.state.service
    return svc


def routing_override(
    request: Request, who: Annotated[Principal, Depends(require_principal)]
) -> RoutingPolicy | None:
    """``x-vcache-routing`` lets an admin force a policy for one request (comparisons)."""
    value = request.headers.get("x-vcache-routing")
    if value is None:
        return None
    if not who.admin:
        raise PermissionDenied("x-vcache-routing needs an admin key", code="admin_required")
    if value not in POLICIES:
        raise InvalidRequest(
            f"x-vcache-routing must be one of {', '.join(POLICIES)}",
            param="x-vcache-routing",
            code="invalid_value",
        )
    return value  # type: ignore[return-value]


@router.post("/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest,
    who: Annotated[Principal, Depends(require_principal)],
    svc: Annotated[GatewayService, Depends(service)],
    policy: Annotated[RoutingPolicy | None, Depends(routing_override)],
) -> JSONResponse | StreamingResponse:
    if body.stream:
        routed = await svc.chat_stream(body, who, policy)
        return await open_stream(routed.body, routed.headers())
    done = await svc.chat(body, who, policy)
    return JSONResponse(done.body.model_dump(mode="json"), headers=done.headers())
