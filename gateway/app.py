"""The FastAPI application: thin edges over the service core.

Engines, the KV-cache manager and metrics are created per app in
``create_app`` and the lifespan; nothing lives at module level.  The
replicas load in a tracked task so ``/healthz`` answers while the model
loads, and ``/readyz`` turns ready when every replica is up and probed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import FastAPI

from engines.base import Engine
from engines.tokenizer import ChatTokenizer
from gateway.auth import KeyRing
from gateway.config import Settings
from gateway.dispatch import Dispatcher
from gateway.fallback import Targets
from gateway.grpc_server import GatewayServicer, GrpcServer
from gateway.http_errors import install_error_handlers
from gateway.kvcache import CoreControlled, KVCacheManager
from gateway.metrics import Metrics
from gateway.middleware import BodyLimitMiddleware, RequestMetricsMiddleware
from gateway.provider_chat import ProviderChat
from gateway.providers import ProviderPath, adapter_for
from gateway.reconstruct import Reconstructor
from gateway.replicas import LocalReplica, Replica, Router
from gateway.routers import cache, chat, completions, health, models, responses
from gateway.service import GatewayService
from gateway.session_log import SessionLog
from gateway.session_store import SessionStore
from manifest.index import LocationId

log = logging.getLogger(__name__)

PROBE_TEXT = "vcache probe: the manifest must hash blocks exactly as the engine does. "


async def _start(
    app: FastAPI,
    built: Sequence[LocalReplica],
    dispatcher: Dispatcher,
    grpc_server: GrpcServer | None,
) -> None:
    settings: Settings = app.state.settings
    try:
        for r in built:  # one at a time: each engine sizes its memory on start
            await r.engine.start()
        tracked = [r for r in built if r.events_endpoint and hasattr(r.engine, "call_core")]
        if tracked:
            first = built[0].engine
            kv = KVCacheManager(
                block_size=first.capabilities.block_size,
                hash_seed=settings.engine.hash_seed,
                pin_max_share=settings.cache.pin_max_share,
                default_lease_s=settings.cache.default_lease_s,
            )
            for r in tracked:
                assert r.events_endpoint is not None
                engine: CoreControlled = r.engine  # type: ignore[assignment]
                kv.attach(r.id, engine, r.events_endpoint, r.replay_endpoint)
            probe = first.tokenizer.encode(PROBE_TEXT * 64)[: 2 * kv.block_size + 1]
            app.state.kv = kv
            await kv.start(probe)
            dispatcher.kv = kv
        dispatcher.started = True
        if grpc_server is not None:
            await grpc_server.serving()
    except Exception as exc:
        log.exception("engine failed to start")
        app.state.engine_failure = f"{type(exc).__name__}: {exc}"


def _session_log(settings: Settings, replicas: Sequence[Replica]) -> SessionLog | None:
    cfg = settings.session_log
    if not cfg.enabled:
        return None
    store = SessionStore(cfg.db_path(settings.data_dir), cfg.fsync)
    if cfg.retention_days is not None or cfg.retention_max_bytes is not None:
        age = cfg.retention_days * 86400 if cfg.retention_days is not None else None
        dropped = store.retain(age, cfg.retention_max_bytes)
        if dropped:
            log.info("session log retention: dropped %d sessions", dropped)

    def tokenizer() -> ChatTokenizer | None:
        return replicas[0].engine.tokenizer if replicas and replicas[0].engine.ready else None

    return SessionLog(store, Reconstructor(adapter_for, tokenizer), cfg.verify_reconstruction)


def create_app(
    settings: Settings,
    built: Sequence[LocalReplica | Engine],
    provider_clock: Callable[[], float] = time.monotonic,
) -> FastAPI:
    """An app over ``built`` replicas (bare engines become replicas without KV events) and,
    when ``settings.providers`` names any, the hosted providers (TTLs on ``provider_clock``)."""
    metrics = Metrics()
    providers = ProviderPath(settings, metrics, provider_clock) if settings.providers else None
    local = [
        b if isinstance(b, LocalReplica) else LocalReplica(LocationId(f"replica-{i}"), b)
        for i, b in enumerate(built)
    ]
    replicas = [Replica(r.id, r.engine) for r in local]
    router = Router(settings.cache.routing, settings.cache.load_imbalance)
    dispatcher = Dispatcher(
        replicas, router, None, metrics, max_inflight=settings.engine.max_queued_requests
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics.watch_engine(dispatcher.stats)
        grpc_server = None
        if settings.grpc_port is not None:
            servicer = GatewayServicer(app.state.service, app.state.keyring, lambda: app.state.kv)
            grpc_server = GrpcServer(
                servicer, settings.host, settings.grpc_port, settings.max_request_body_bytes
            )
            await grpc_server.start()
        app.state.grpc = grpc_server
        starting = asyncio.create_task(
            _start(app, local, dispatcher, grpc_server), name="engine-start"
        )
        try:
            yield
        finally:
            if grpc_server is not None:
                await grpc_server.stop(grace_s=5)
            if not starting.done():
                starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            kv: KVCacheManager | None = app.state.kv
            if kv is not None:
                await kv.close()
            for r in local:
                await r.engine.close()
            if providers is not None:
                await providers.close()
            if session_log is not None:
                session_log.close()

    app = FastAPI(title="vcache", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.engine_failure = None
    app.state.kv = None
    app.state.keyring = KeyRing(settings.api_keys)
    app.state.providers = providers
    session_log = _session_log(settings, replicas)
    app.state.session_log = session_log
    app.state.service = GatewayService(
        dispatcher,
        model_name=settings.model_name,
        targets=Targets(
            settings.model_name if local else None, settings.aliases, list(settings.providers)
        ),
        providers=(
            ProviderChat(providers, settings.prompt_layout, session_log) if providers else None
        ),
        metrics=metrics,
        log=session_log,
    )
    install_error_handlers(app, metrics)
    routers = (health, models, chat, completions, responses, cache)
    for r in (m.router for m in routers):
        app.include_router(r)
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_request_body_bytes, metrics=metrics)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    return app
