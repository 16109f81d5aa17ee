"""POST /v1/completions"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, StreamingResponse

from gateway.core.outputs import Completion
from gateway.core.schemas import CompletionRequest
from gateway.core.types import Principal, RouteOverride
from gateway.http.openapi import GENERATION, streamed
from gateway.http.routes.chat import routing_override, service
from gateway.http.sse import open_stream
from gateway.service.auth import require_principal
from gateway.service.chat import GatewayService

router = APIRouter(prefix="/v1", tags=["completions"])


@router.post("/completions", response_model=None, responses={**streamed(Completion), **GENERATION})
async def create_completion(
    body: CompletionRequest,
    who: Annotated[Principal, Depends(require_principal)],
    svc: Annotated[GatewayService, Depends(service)],
    route: Annotated[RouteOverride | None, Depends(routing_override)],
) -> JSONResponse | StreamingResponse:
    if body.stream:
        routed = await svc.complete_stream(body, who, route)
        return await open_stream(routed.body, routed.headers())
    done = await svc.complete(body, who, route)
    return JSONResponse(done.body.model_dump(mode="json"), headers=done.headers())
