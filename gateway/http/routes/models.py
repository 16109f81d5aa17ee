"""GET /v1/models, GET /v1/models/{model}"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from gateway.core.outputs import ModelCard, ModelList
from gateway.http.deps import service
from gateway.http.openapi import errors
from gateway.service.auth import require_principal
from gateway.service.chat import GatewayService

router = APIRouter(prefix="/v1", tags=["models"], dependencies=[Depends(require_principal)])


@router.get("/models", responses=errors(401, 503))
async def list_models(svc: Annotated[GatewayService, Depends(service)]) -> ModelList:
    return svc.models()


@router.get("/models/{model:path}", responses=errors(401, 404, 503))
async def retrieve_model(model: str, svc: Annotated[GatewayService, Depends(service)]) -> ModelCard:
    """One model the gateway serves (ids may contain '/', as aliases of providers do)."""
    return svc.model(model)
