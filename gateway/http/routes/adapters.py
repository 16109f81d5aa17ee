"""Admin API over the local replicas' LoRA adapters, in vLLM's request shapes:
POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter (on every serving replica, or
the one ``replica`` names), GET /v1/lora_adapters (which replica holds which).  An
admin key is needed, as for the cache API; the local chat's adapters
(gateway/local/adapters.py) do the work."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from gateway.core.types import Principal
from gateway.http.deps import service
from gateway.http.openapi import COMMON, errors
from gateway.http.routes.cache import require_admin
from gateway.service.chat import GatewayService

router = APIRouter(tags=["adapters"])  # under /v1: included by the models router
ADAPTER_ERRORS = errors(*COMMON, 403, 404)

_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's ``/v1/load_lora_adapter`` body; ``replica``: only that one (vcache's)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(pattern=_NAME)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False  # vLLM's: replace a name loaded at another path (always so here)
    replica: str | None = None


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's ``/v1/unload_lora_adapter`` body; ``replica``: only that one (vcache's)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's, unused: vcache names an adapter by its name
    replica: str | None = None


class AdapterResponse(BaseModel):
    model_config = ConfigDict(extra="allow")

    object: str = "lora_adapter"
    lora_name: str
    lora_path: str | None = None
    replicas: list[str]  # where it was loaded (unloaded)


class AdapterEntry(BaseModel):
    model_config = ConfigDict(extra="allow")

    lora_name: str
    lora_path: str
    replicas: list[str]  # the replicas that hold it now
    sha256: str | None = None  # of its weights files as last read (None: not on this host)
    leased: list[str] = []  # the replicas where pinned spans under it keep it loaded
    load_bytes: int | None = None  # its last load, measured (None: not loaded by vcache)
    load_seconds: float | None = None


class AdapterList(BaseModel):
    model_config = ConfigDict(extra="allow")

    object: str = "list"
    data: list[AdapterEntry]
    loads: int = 0  # adapter loads this gateway sent to engines
    evictions: int = 0  # adapters it let go to make room for a load


Admin = Annotated[Principal, Depends(require_admin)]
Service = Annotated[GatewayService, Depends(service)]


@router.post("/load_lora_adapter", responses=ADAPTER_ERRORS)
async def load_lora_adapter(
    body: LoadLoraAdapterRequest, who: Admin, svc: Service
) -> AdapterResponse:
    """Load an adapter (then served as a model: ``model: <lora_name>``); a bad path or
    a rank above ``engine.lora.max_lora_rank`` is a 400 naming why."""
    adapters = svc.local.served_adapters()
    done = await adapters.load_path(body.lora_name, body.lora_path, body.replica)
    return AdapterResponse(lora_name=body.lora_name, lora_path=body.lora_path, replicas=done)


@router.post("/unload_lora_adapter", responses=ADAPTER_ERRORS)
async def unload_lora_adapter(
    body: UnloadLoraAdapterRequest, who: Admin, svc: Service
) -> AdapterResponse:
    """Unload an adapter; requests running under it finish.  Not loaded: a 404."""
    done = await svc.local.served_adapters().unload(body.lora_name, body.replica)
    return AdapterResponse(lora_name=body.lora_name, replicas=done)


@router.get("/lora_adapters", responses=errors(400, 401, 403, 503))
async def lora_adapters(who: Admin, svc: Service) -> AdapterList:
    """Each adapter known: its path, the replicas that hold it now, the sha256 of its
    weights, where leases keep it and what its last load cost (a 400 when the local
    engines run without LoRA)."""
    adapters = svc.local.served_adapters()
    await adapters.learn_all()
    where = adapters.residency()
    data = []
    for a in adapters.listed():
        cost = adapters.costs.get(a.name)
        data.append(
            AdapterEntry(
                lora_name=a.name,
                lora_path=a.path,
                replicas=where.get(a.name, []),
                sha256=adapters.digest(a),
                leased=adapters.leased_on(a.name),
                load_bytes=cost.bytes if cost is not None else None,
                load_seconds=round(cost.seconds, 4) if cost is not None else None,
            )
        )
    return AdapterList(data=data, loads=adapters.loads, evictions=adapters.evictions)
