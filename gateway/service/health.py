"""Liveness and readiness of the gateway, from its replicas' states (the HTTP probes
``/healthz``, ``/readyz`` and gRPC health read them)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from gateway.local.supervisor import Supervisor
from gateway.service.chat import GatewayService

Status = Literal["ok", "ready", "degraded", "starting", "engine_dead", "failed"]


class ReplicaStatus(BaseModel):
    state: Literal["starting", "ready", "dead", "restarting", "failed"]
    restarts: int
    last_error: str | None = None


class HealthStatus(BaseModel):
    status: Status
    error: str | None = None
    replicas: dict[str, ReplicaStatus] = {}


class Health:
    def __init__(self, supervisor: Supervisor, service: GatewayService) -> None:
        self._supervisor = supervisor
        self._service = service

    def status(self, readiness: bool) -> tuple[int, HealthStatus]:
        """(HTTP status, body): liveness, or with ``readiness`` whether it can serve now."""
        sup = self._supervisor
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
        if not self._service.ready:
            return 503, HealthStatus(status="starting", replicas=replicas)
        degraded = any(r.state != "ready" for r in replicas.values())
        return 200, HealthStatus(status="degraded" if degraded else "ready", replicas=replicas)
