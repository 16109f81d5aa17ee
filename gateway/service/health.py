"""Liveness and readiness of the gateway, from its replicas' states and its shared
stores' (the HTTP probes ``/healthz``, ``/readyz`` and gRPC health read them).

A shared store (the session log's database, the Redis state) that fails for
a moment leaves the gateway ready and ``degraded``; one that has failed for
longer than its grace period makes readiness fail, so a load balancer sends
the traffic to the gateways that can still log it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

from gateway.local.supervisor import Supervisor
from gateway.service.chat import GatewayService

Status = Literal[
    "ok", "ready", "degraded", "starting", "engine_dead", "store_unavailable", "failed"
]


@dataclass(frozen=True)
class StoreProbe:
    name: str  # "session_log", "state"
    failing_since: Callable[[], float | None]  # time.monotonic() of the first failure
    grace_s: float

    def state(self, now: float) -> Literal["ok", "degraded", "unavailable"]:
        since = self.failing_since()
        if since is None:
            return "ok"
        return "unavailable" if now - since > self.grace_s else "degraded"


class ReplicaStatus(BaseModel):
    state: Literal["starting", "ready", "dead", "restarting", "failed"]
    restarts: int
    last_error: str | None = None


class HealthStatus(BaseModel):
    status: Status
    error: str | None = None
    replicas: dict[str, ReplicaStatus] = {}
    stores: dict[str, Literal["ok", "degraded", "unavailable"]] = {}


class Health:
    def __init__(
        self, supervisor: Supervisor, service: GatewayService, stores: Sequence[StoreProbe] = ()
    ) -> None:
        self._supervisor = supervisor
        self._service = service
        self._stores = stores

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
        now = time.monotonic()
        stores = {p.name: p.state(now) for p in self._stores}
        down = [name for name, state in stores.items() if state == "unavailable"]
        if down:
            error = f"unreachable beyond the grace period: {', '.join(down)}"
            body = HealthStatus(
                status="store_unavailable", error=error, replicas=replicas, stores=stores
            )
            return 503, body
        degraded = any(r.state != "ready" for r in replicas.values()) or any(
            state != "ok" for state in stores.values()
        )
        status: Status = "degraded" if degraded else "ready"
        return 200, HealthStatus(status=status, replicas=replicas, stores=stores)
