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
import os
import time
from collections.abc import AsyncIterator, Callable, Sequence

from fastapi import FastAPI

from engines.base import Engine
from engines.providers.specs import adapter_for
from engines.providers.transport import Transport
from engines.tokenizer import ChatTokenizer, ThreadCopies
from gateway.core.config import Settings
from gateway.core.loop_watch import LoopWatch, freeze_startup_heap
from gateway.core.metrics import MULTIPROC_ENV, Metrics
from gateway.core.tracing import Tracing
from gateway.core.types import ENGINE_PRIORITY
from gateway.core.version import version_info
from gateway.grpc.server import GatewayServicer, GrpcServer
from gateway.http.errors import install_error_handlers
from gateway.http.middleware import BodyLimitMiddleware, RequestMetricsMiddleware, ServerLoad
from gateway.http.openapi import install_openapi
from gateway.http.routes import (
    cache,
    chat,
    completions,
    health,
    messages,
    models,
    responses,
    sagemaker,
    tokenize,
)
from gateway.local.dispatch import Dispatcher
from gateway.local.governor import LocalGovernor
from gateway.local.pauses import SessionTurns
from gateway.local.replicas import Replica
from gateway.local.retention import BreakpointLeases
from gateway.local.routing import Router
from gateway.local.supervisor import Supervisor
from gateway.providers.control import Control
from gateway.providers.path import ProviderPath
from gateway.service.auth import KeyRing
from gateway.service.cache import CacheService
from gateway.service.chat import GatewayService
from gateway.service.health import Health, StoreProbe
from gateway.service.provider_chat import ProviderChat
from gateway.service.shared_state import share_key_limits, share_provider_state
from gateway.service.targets import Targets
from gateway.sessions.log import SessionLog
from gateway.sessions.reconstruct import Reconstructor
from gateway.sessions.store import SessionStore
from gateway.state.bus import LocalBus, StateBus
from gateway.state.redis_bus import RedisBus
from manifest.index import LocationId

log = logging.getLogger(__name__)


def _session_log(settings: Settings, replicas: Sequence[Replica]) -> SessionLog | None:
    cfg = settings.session_log
    if not cfg.enabled:
        return None
    store = SessionStore(cfg.db_path(settings.data_dir), cfg.fsync, url=cfg.url)

    copies = ThreadCopies()  # a rebuild to verify runs on a worker thread: a copy there

    def tokenizer() -> ChatTokenizer | None:
        ready = [r.engine for r in replicas if r.engine.ready]
        return copies(ready[0].tokenizer) if ready else None

    rebuild = Reconstructor(adapter_for, tokenizer)
    return SessionLog(store, rebuild, cfg.verify_reconstruction, cfg.cached_sessions)


async def _retain_forever(settings: Settings, session_log: SessionLog) -> None:
    """Session-log retention at start, then every ``retention_interval_s``."""
    cfg = settings.session_log
    if cfg.retention_days is None and cfg.retention_max_bytes is None:
        return
    age = cfg.retention_days * 86400 if cfg.retention_days is not None else None
    while True:
        try:
            dropped = await session_log.retain(age, cfg.retention_max_bytes)
            if dropped:
                log.info("session log retention: dropped %d sessions", dropped)
        except Exception:
            log.exception("session log retention failed; retrying later")
        await asyncio.sleep(cfg.retention_interval_s)


def banner(settings: Settings, service: GatewayService, grpc_port: int | None = None) -> str:
    """What is serving where, once every replica is up (the line to look for in the log)."""
    host = settings.host if settings.host not in ("0.0.0.0", "::") else "127.0.0.1"
    local = len(service.dispatcher.replicas)
    lines = [
        "vcache is ready",
        f"  OpenAI API   http://{host}:{settings.port}/v1   (docs: /docs, health: /readyz)",
        f"  metrics      http://{host}:{settings.port}/metrics",
        f"  models       {', '.join(m.id for m in service.models().data)}",
        f"  replicas     {local} local" + (", exact KV spans" if service.dispatcher.kv else ""),
    ]
    if grpc_port is not None:
        lines.insert(2, f"  gRPC         {host}:{grpc_port}   (vcache.v1.Gateway)")
    if settings.providers:
        lines.append(f"  providers    {', '.join(settings.providers)}")
    return "\n".join(lines)


def _state_bus(settings: Settings) -> StateBus:
    cfg = settings.state
    if cfg.url is None:  # workers without a shared store: worker 0 holds every role
        return LocalBus(settings.instance_id, leader=settings.worker_index == 0)
    return RedisBus(cfg.url, settings.instance_id, cfg.prefix, cfg.role_ttl_s)


def _scaled(clock: Callable[[], float], scale: float) -> Callable[[], float]:
    start = clock()
    return lambda: start + (clock() - start) * scale


def create_app(
    settings: Settings,
    built: Sequence[Replica | Engine],
    provider_clock: Callable[[], float] = time.monotonic,
    tracing: Tracing | None = None,
    provider_transport: Transport | None = None,
) -> FastAPI:
    """An app over ``built`` replicas (bare engines become replicas without KV events) and,
    when ``settings.providers`` names any, the hosted providers (TTLs on ``provider_clock``;
    ``provider_transport``: how requests reach them, aiohttp by default)."""
    metrics = Metrics(os.environ.get(MULTIPROC_ENV) if settings.workers > 1 else None)
    tracing = tracing or Tracing(settings.otlp_endpoint)
    if settings.control.clock_scale != 1.0:  # a load test against a time-scaled emulator
        provider_clock = _scaled(provider_clock, settings.control.clock_scale)
    providers = (
        ProviderPath(settings, metrics, provider_clock, transport=provider_transport)
        if settings.providers
        else None
    )
    control = Control(settings.control, provider_clock, retention=settings.cache.retention)
    bus = _state_bus(settings)
    if providers is not None:
        providers.control = control
        share_provider_state(bus, providers, control, settings.control.clock_scale)
    replicas = [
        b if isinstance(b, Replica) else Replica(LocationId(f"replica-{i}"), b)
        for i, b in enumerate(built)
    ]
    router = Router(settings.cache.routing, settings.cache.load_imbalance, metrics.count_routing)
    dispatcher = Dispatcher(
        replicas,
        router,
        None,
        metrics,
        max_inflight=settings.engine.max_queued_requests,
        model=settings.model_name,
        room=settings.engine.admission_room(),
        slots=settings.engine.max_num_seqs,
        first_token_guard=settings.engine.first_token_guard,
        preempt_prefills=settings.engine.preempt_prefills,
        refresh=settings.cache.refresh_predicted,
        prefill_slots={ENGINE_PRIORITY[p]: n for p, n in settings.engine.prefill_slots.items()},
    )
    supervisor = Supervisor(
        dispatcher,
        pin_max_share=settings.cache.pin_max_share,
        default_lease_s=settings.cache.default_lease_s,
        poll_s=settings.engine.watch_interval_s,
        backoff_base_s=settings.engine.restart_backoff_s,
        backoff_cap_s=settings.engine.restart_backoff_cap_s,
        instance_id=settings.instance_id,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics.watch_engines(dispatcher.replica_stats)
        grpc_server = None
        if settings.grpc_port is not None:
            servicer = GatewayServicer(app.state.service, app.state.keyring, app.state.cache)
            grpc_server = GrpcServer(
                servicer,
                settings.host,
                settings.grpc_port,
                settings.max_request_body_bytes,
                reuse_port=settings.workers > 1,
            )
            await grpc_server.start()
        app.state.grpc = grpc_server

        async def health_changed() -> None:
            if grpc_server is not None:
                await grpc_server.set_serving(app.state.service.ready)

        supervisor.on_change = health_changed

        watch = LoopWatch(
            asyncio.get_running_loop(),
            metrics.loop_lag.observe,
            lambda generation, s: metrics.gc_pause.labels(str(generation)).observe(s),
        )
        watch.start()

        async def boot() -> None:
            await supervisor.boot()
            with watch.expected():  # one full collection, then the collector skips it all
                frozen = freeze_startup_heap()
            log.info("froze the startup heap: %d objects out of the collector's passes", frozen)
            if app.state.service.ready:
                port = grpc_server.port if grpc_server is not None else None
                log.info("%s", banner(settings, app.state.service, port))

        await bus.start()
        starting = asyncio.create_task(boot(), name="engine-start")
        steering = []
        if providers is not None and control.enabled:
            warm = app.state.service.warm_provider
            steering.append(asyncio.create_task(control.run(warm), name="provider-control"))
        if local_governor is not None:
            steering.append(asyncio.create_task(local_governor.run(), name="local-governor"))
        retention = None
        if session_log is not None and settings.worker_index == 0:  # one worker retains
            retention = asyncio.create_task(
                _retain_forever(settings, session_log), name="session-retention"
            )
        try:
            yield
        finally:
            for task in (retention, *steering):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            if grpc_server is not None:
                await grpc_server.stop(grace_s=5)
            if not starting.done():
                starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            await supervisor.close()
            app.state.service.close()
            await bus.close()
            watch.stop()
            if providers is not None:
                await providers.close()
            if session_log is not None:
                session_log.close()
            tracing.shutdown()

    app = FastAPI(title="vcache", version=str(version_info()["version"]), lifespan=lifespan)
    app.state.settings = settings
    app.state.bus = bus
    app.state.metrics = metrics
    app.state.supervisor = supervisor
    app.state.keyring = KeyRing(settings.api_keys)
    app.state.providers = providers
    app.state.control = control
    session_log = _session_log(settings, replicas)
    app.state.session_log = session_log
    provider_chat = None
    if providers is not None:
        provider_chat = ProviderChat(providers, settings.prompt_layout, metrics)
    app.state.service = GatewayService(
        dispatcher,
        model_name=settings.model_name,
        targets=Targets(
            settings.model_name if replicas else None, settings.aliases, list(settings.providers)
        ),
        providers=provider_chat,
        metrics=metrics,
        log=session_log,
        tool_parser=settings.engine.tool_parser,
        trust_chat_template=settings.engine.trust_request_chat_template,
        routing=settings.routing,
        max_output_tokens=settings.engine.max_output_tokens,
        ceiling_finish=settings.engine.max_output_tokens_finish,
        tracing=tracing,
        turns=SessionTurns(
            settings.cache.retention,
            BreakpointLeases(),
            count=lambda outcome: metrics.retention.labels(outcome).inc(),
        ),
    )
    local_governor = None
    if settings.control.mode == "govern" and replicas:
        local_governor = LocalGovernor(
            settings.control, lambda: dispatcher.kv, settings.cache.pin_max_share
        )
        app.state.service.local.governor = local_governor
    app.state.local_governor = local_governor
    svc = app.state.service
    app.state.cache = CacheService(
        svc.local, svc.model_name, svc.targets, svc.providers, svc.warm_provider, svc.warm_local
    )
    probes = []
    if session_log is not None:
        grace = settings.session_log.unavailable_grace_s
        probes.append(StoreProbe("session_log", lambda: session_log.writer.failing_since, grace))
    if settings.state.url is not None:
        probes.append(
            StoreProbe("state", lambda: bus.failing_since, settings.state.unavailable_grace_s)
        )
    app.state.health = Health(supervisor, app.state.service, probes)
    share_key_limits(bus, app.state.service.limits)
    install_error_handlers(app, metrics)
    install_openapi(app)
    routers = (health, models, chat, completions, responses, messages, cache, tokenize, sagemaker)
    for r in (m.router for m in routers):
        app.include_router(r)
    app.add_middleware(
        BodyLimitMiddleware,
        limit=settings.max_request_body_bytes,
        metrics=metrics,
        chunk_timeout_s=settings.http.body_timeout_s,
    )
    app.state.server_load = ServerLoad()
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics, load=app.state.server_load)
    return app
