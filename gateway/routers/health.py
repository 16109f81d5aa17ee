"""GET /healthz (alive), /readyz (engine ready), /metrics (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.metrics import Metrics

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz(request: Request) -> JSONResponse:
    """Alive while loading; fails once the engine failed to start, so supervisors restart us."""
    failure = request.app.state.engine_failure
    if failure:
        return JSONResponse({"status": "failed", "error": failure}, status_code=503)
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    state = request.app.state
    if state.service.ready:
        return JSONResponse({"status": "ready"})
    failure = getattr(state, "engine_failure", None)
    body = {"status": "failed" if failure else "starting"}
    if failure:
        body["error"] = failure
    return JSONResponse(body, status_code=503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    m: Metrics = request.app.state.metrics
    return Response(m.render(), media_type=CONTENT_TYPE_LATEST)
