"""Probes and metadata: /healthz and /health (alive), /readyz (can serve), /version, /metrics.

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

from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from gateway.core.metrics import Metrics
from gateway.core.version import version_info
from gateway.local.supervisor import Supervisor

router = APIRouter(tags=["health"])

Status = Literal["ok", "ready", "degraded", "starting", "engine_dead", "failed"]


class ReplicaStatus(BaseModel):
    state: Literal["starting", "ready", "dead", "restarting", "failed"]
    restarts: int
    last_error: str | None = None


class HealthStatus(BaseModel):
    status: Status
    error: str | None = None
    replicas: dict[str, ReplicaStatus] = {}


class VersionInfo(BaseModel):
    version: str
    vllm: str | None = None
    python: str


def _status(request: Request, readiness: bool) -> tuple[int, HealthStatus]:
    state = request.app.state
    sup: Supervisor = state.supervisor
    replicas = {k: ReplicaStatus.model_validate(v) for k, v in sup.report().items()}
    if sup.boot_failure is not None:
        return 503, HealthStatus(status="failed", error=sup.boot_failure, replicas=replicas)
    if sup.engine_dead:
        body = HealthStatus(
            status="engine_dead", error="every local replica is dead", replicas=replicas
        )
        return 503, body
    if not readiness:
        return 200, HealthStatus(status="ok", replicas=replicas)
    if not state.service.ready:
        return 503, HealthStatus(status="starting", replicas=replicas)
    degraded = any(r.state != "ready" for r in replicas.values())
    return 200, HealthStatus(status="degraded" if degraded else "ready", replicas=replicas)


_HEALTH: dict[int | str, dict[str, Any]] = {503: {"model": HealthStatus}}


@router.get("/healthz", response_model=HealthStatus, responses=_HEALTH)
async def healthz(request: Request) -> JSONResponse:
    """Alive (loading included); 503 once the engine failed to start or every replica died."""
    code, body = _status(request, readiness=False)
    return JSONResponse(body.model_dump(mode="json"), status_code=code)


@router.get("/health", response_model=HealthStatus, responses=_HEALTH)
async def health(request: Request) -> JSONResponse:
    """The same as ``/healthz``, at the path vLLM and benchmark tools probe."""
    return await healthz(request)


@router.get("/readyz", response_model=HealthStatus, responses=_HEALTH)
async def readyz(request: Request) -> JSONResponse:
    """200 when a request can be served now; 503 while starting or with no live replica."""
    code, body = _status(request, readiness=True)
    return JSONResponse(body.model_dump(mode="json"), status_code=code)


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
