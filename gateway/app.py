"""The FastAPI application: thin edges over the service core.

Engines, stores and metrics are created per app in ``create_app`` and the
lifespan; nothing lives at module level.  The engine loads in a tracked task
so ``/healthz`` answers while the model loads and ``/readyz`` turns ready
when it is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from engines.base import Engine
from gateway.auth import KeyRing
from gateway.config import Settings
from gateway.http_errors import install_error_handlers
from gateway.metrics import Metrics
from gateway.middleware import BodyLimitMiddleware, RequestMetricsMiddleware
from gateway.routers import chat, completions, health, models
from gateway.service import GatewayService

log = logging.getLogger(__name__)


async def _start_engine(app: FastAPI, engine: Engine) -> None:
    try:
        await engine.start()
    except Exception as exc:
        log.exception("engine failed to start")
        app.state.engine_failure = f"{type(exc).__name__}: {exc}"


def create_app(settings: Settings, engine: Engine) -> FastAPI:
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics.watch_engine(engine.stats)
        starting = asyncio.create_task(_start_engine(app, engine), name="engine-start")
        try:
            yield
        finally:
            if not starting.done():
                starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            await engine.close()

    app = FastAPI(title="vcache", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.engine_failure = None
    app.state.keyring = KeyRing(settings.api_keys)
    app.state.service = GatewayService(
        engine,
        model_name=settings.model_name,
        metrics=metrics,
        max_inflight=settings.engine.max_queued_requests,
    )
    install_error_handlers(app, metrics)
    for r in (health.router, models.router, chat.router, completions.router):
        app.include_router(r)
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_request_body_bytes, metrics=metrics)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    return app
