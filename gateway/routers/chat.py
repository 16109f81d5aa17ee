"""POST /v1/chat/completions"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from gateway.auth import require_principal
from gateway.routers.sse import open_stream
from gateway.schemas import ChatCompletion, ChatCompletionRequest
from gateway.service import GatewayService, Principal

router = APIRouter(prefix="/v1", tags=["chat"])


def service(request: Request) -> GatewayService:
    svc: GatewayService = request.app.state.service
    return svc


@router.post("/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest,
    who: Annotated[Principal, Depends(require_principal)],
    svc: Annotated[GatewayService, Depends(service)],
) -> ChatCompletion | StreamingResponse:
    if body.stream:
        return await open_stream(svc.chat_stream(body, who))
    return await svc.chat(body, who)
