"""GET /v1/models"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from gateway.auth import require_principal
from gateway.openapi import errors
from gateway.routers.chat import service
from gateway.schemas import ModelList
from gateway.service import GatewayService

router = APIRouter(prefix="/v1", tags=["models"], dependencies=[Depends(require_principal)])


@router.get("/models", responses=errors(401, 503))
async def list_models(svc: Annotated[GatewayService, Depends(service)]) -> ModelList:
    return svc.models()
