"""GET /v1/models, GET /v1/models/{model} (the local model, its LoRA adapters with
``parent`` and ``root`` as vLLM lists them, the aliases); the adapters' admin routes
(gateway/http/routes/adapters.py) ride on this router."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends

from gateway.core.outputs import ModelCard, ModelList
from gateway.http.deps import service
from gateway.http.openapi import errors
from gateway.http.routes import adapters
from gateway.service.auth import require_principal
from gateway.service.chat import GatewayService

router = APIRouter(prefix="/v1", tags=["models"], dependencies=[Depends(require_principal)])


@router.get("/models", responses=errors(401, 503))
async def list_models(svc: Annotated[GatewayService, Depends(service)]) -> ModelList:
    await svc.local.learn_adapters()
    return svc.models()


@router.get("/models/{model:path}", responses=errors(401, 404, 503))
async def retrieve_model(model: str, svc: Annotated[GatewayService, Depends(service)]) -> ModelCard:
    """One model the gateway serves (ids may contain '/', as aliases of providers do)."""
    await svc.local.learn_adapters()
    return svc.model(model)


router.include_router(adapters.router)  # /v1/load_lora_adapter, ...
