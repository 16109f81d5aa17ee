"""POST /v1/completions"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import StreamingResponse

from gateway.auth import require_principal
from gateway.routers.chat import service
from gateway.routers.sse import open_stream
from gateway.schemas import Completion, CompletionRequest
from gateway.service import GatewayService, Principal

router = APIRouter(prefix="/v1", tags=["completions"])


@router.post("/completions", response_model=None)
async def create_completion(
    body: CompletionRequest,
    who: Annotated[Principal, Depends(require_principal)],
    svc: Annotated[GatewayService, Depends(service)],
) -> Completion | StreamingResponse:
    if body.stream:
        return await open_stream(svc.complete_stream(body, who))
    return await svc.complete(body, who)
