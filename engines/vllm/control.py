"""The control endpoint of a remote vLLM replica: the engine-core plugin over HTTP.

A replica started as ``python -m vllm.entrypoints.openai.api_server`` loads
this as a vLLM endpoint plugin (entry point ``vllm.endpoint_plugins:
vcache-control``; vLLM loads endpoint plugins only when named in
``VLLM_PLUGINS``, e.g. ``VLLM_PLUGINS=vcache,vcache-control``).  It adds

    POST /vcache/v1/control/{method}    body {"args": [...]}  ->  {"result": ...}

on the API server's own port, for the methods of ``engines/vllm/plugin.py``,
reached through the server's engine client (utility calls).  Every call needs
the header ``x-vcache-control-secret`` equal to ``VCACHE_CONTROL_SECRET`` in
the server's environment (no secret set: every call is refused), and comes
from loopback unless ``VCACHE_CONTROL_ALLOW_REMOTE=1``.

Bytes (block hashes) travel as ``{"$bytes": "<hex>"}``.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

CONTROL_PATH = "/vcache/v1/control/{method}"
SECRET_HEADER = "x-vcache-control-secret"
METHODS = frozenset(
    {
        "vcache_pin",
        "vcache_unpin",
        "vcache_sweep",
        "vcache_evict",
        "vcache_touch",
        "vcache_hold",
        "vcache_release",
        "vcache_cache_stats",
        "vcache_resident",
        "vcache_events_barrier",
    }
)


def to_wire(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        return {"$bytes": bytes(value).hex()}
    if isinstance(value, list | tuple):
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    return value


def from_wire(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"$bytes"}:
            return bytes.fromhex(value["$bytes"])
        return {k: from_wire(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_wire(v) for v in value]
    return value


def _loopback(host: str | None) -> bool:
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class VcacheControlPlugin:
    """vLLM ``EndpointPlugin``: attaches the control route to the API server."""

    name = "vcache-control"
    required_tasks = None

    def attach_router(self, app: Any) -> None:
        async def control(method: str, request: Request) -> JSONResponse:
            secret = os.environ.get("VCACHE_CONTROL_SECRET", "")
            given = request.headers.get(SECRET_HEADER, "")
            if not secret or not hmac.compare_digest(secret.encode(), given.encode()):
                return JSONResponse({"error": "bad or missing control secret"}, status_code=403)
            remote_ok = os.environ.get("VCACHE_CONTROL_ALLOW_REMOTE") == "1"
            if not remote_ok and not _loopback(request.client.host if request.client else None):
                return JSONResponse({"error": "control is loopback-only"}, status_code=403)
            if method not in METHODS:
                return JSONResponse({"error": f"unknown method {method}"}, status_code=404)
            engine = getattr(request.app.state, "vcache_engine_client", None)
            if engine is None:
                return JSONResponse({"error": "no engine"}, status_code=503)
            body = await request.json()
            args = from_wire(body.get("args", []))
            result = await engine.engine_core.call_utility_async(method, *args)
            return JSONResponse({"result": to_wire(result)})

        app.add_api_route(CONTROL_PATH, control, methods=["POST"], include_in_schema=False)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        state.vcache_engine_client = engine_client


def plugin() -> VcacheControlPlugin:
    """Entry point factory."""
    return VcacheControlPlugin()
