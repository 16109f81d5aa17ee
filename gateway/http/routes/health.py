"""Probes and metadata: /healthz and /health (alive), /readyz (can serve), /load,
/version, /metrics.

``/healthz`` (and ``/health``, the path vLLM, guidellm and most probes call)
is 200 while the process can do its job, loading included, and 503 once the
local engine failed to start or every local replica is dead: an orchestrator
that keeps seeing it restarts the gateway, the last resort after the
gateway's own restarts.  ``/readyz`` is 200 when requests can be served now:
``ready``, or ``degraded`` when some replicas are being restarted; 503 with
``starting``, ``engine_dead`` or ``failed`` otherwise.  Both list each
replica's state and restart count.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from gateway.core.metrics import Metrics
from gateway.core.version import version_info
from gateway.service.health import Health, HealthStatus

router = APIRouter(tags=["health"])


class VersionInfo(BaseModel):
    version: str
    vllm: str | None = None
    python: str


_HEALTH: dict[int | str, dict[str, Any]] = {503: {"model": HealthStatus}}


@router.get("/healthz", response_model=HealthStatus, responses=_HEALTH)
async def healthz(request: Request) -> JSONResponse:
    """Alive (loading included); 503 once the engine failed to start or every replica died."""
    health: Health = request.app.state.health
    code, body = health.status(readiness=False)
    return JSONResponse(body.model_dump(mode="json"), status_code=code)


@router.get("/health", response_model=HealthStatus, responses=_HEALTH)
async def health(request: Request) -> JSONResponse:
    """The same as ``/healthz``, at the path vLLM and benchmark tools probe."""
    return await healthz(request)


@router.get("/readyz", response_model=HealthStatus, responses=_HEALTH)
async def readyz(request: Request) -> JSONResponse:
    """200 when a request can be served now; 503 while starting or with no live replica."""
    health: Health = request.app.state.health
    code, body = health.status(readiness=True)
    return JSONResponse(body.model_dump(mode="json"), status_code=code)


class LoadInfo(BaseModel):
    server_load: int  # requests on the generation routes now


@router.get("/load", response_model=LoadInfo)
async def load(request: Request) -> LoadInfo:
    """vLLM's server load: the requests being served now (what load-aware routers read)."""
    return LoadInfo(server_load=request.app.state.server_load.running)


@router.get("/version", response_model=VersionInfo)
async def version() -> VersionInfo:
    return VersionInfo.model_validate(version_info())


@router.get(
    "/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}}
)
async def metrics(request: Request) -> Response:
    """Prometheus text exposition."""
    m: Metrics = request.app.state.metrics
    return Response(m.render(), media_type=CONTENT_TYPE_LATEST)
