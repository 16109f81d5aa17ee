"""POST /tokenize, POST /detokenize (vLLM's; see gateway/service/tokenize.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from gateway.core.types import Principal
from gateway.http.deps import service
from gateway.http.openapi import errors
from gateway.service.auth import require_principal
from gateway.service.chat import GatewayService
from gateway.service.tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    detokenize,
    tokenize,
)

router = APIRouter(tags=["tokenize"])
Svc = Annotated[GatewayService, Depends(service)]
Who = Annotated[Principal, Depends(require_principal)]


@router.post("/tokenize", responses=errors(400, 401, 404, 413, 503))
async def tokenize_route(body: TokenizeRequest, who: Who, svc: Svc) -> TokenizeResponse:
    return await tokenize(svc, body, who)


@router.post("/detokenize", responses=errors(400, 401, 404, 503))
async def detokenize_route(body: DetokenizeRequest, who: Who, svc: Svc) -> DetokenizeResponse:
    return detokenize(svc, body)
