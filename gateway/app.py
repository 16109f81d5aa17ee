"""The FastAPI application: thin edges over the service core.

The one composition root: :func:`create_app` builds every collaborator in
dependency order (the state bus, the hosted providers, the local replicas'
set, dispatcher and chat, the session log, the service core, the supervisor)
and hands each to the constructors of those that use it; nothing is assigned
onto an object after it is built.  What runs (the state bus, the gRPC server,
the replicas, the control loops, retention) is started and stopped by
:func:`lifespan`; nothing lives at module level.  The replicas load in a
tracked task so ``/healthz`` answers while the model loads, and ``/readyz``
turns ready when every replica is up and probed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass

from fastapi import FastAPI

from engines.base import Engine
from engines.providers.specs import adapter_for
from engines.providers.transport import Transport
from engines.tokenizer import ChatTokenizer, ThreadCopies
from gateway.batches.hit_share import HitShares
from gateway.batches.pins import CachePins
from gateway.batches.provider_api import ProviderBatches
from gateway.batches.provider_client import BatchAPIClient
from gateway.batches.recall import default_gate
from gateway.batches.runner import BatchRunner
from gateway.batches.send import ServiceSender
from gateway.batches.store import BatchStore
from gateway.batches.targets import BatchTargets
from gateway.core.config import Settings
from gateway.core.loop_watch import LoopWatch, freeze_startup_heap
from gateway.core.metrics import MULTIPROC_ENV, Metrics
from gateway.core.tracing import Tracing
from gateway.core.types import ENGINE_PRIORITY
from gateway.core.version import version_info
from gateway.grpc.server import GatewayServicer, GrpcServer
from gateway.http.direct import DirectRoutes
from gateway.http.errors import install_error_handlers
from gateway.http.middleware import (
    UPLOAD_PATHS,
    BodyLimitMiddleware,
    RequestMetricsMiddleware,
    ServerLoad,
)
from gateway.http.openapi import install_openapi
from gateway.http.routes import (
    batches,
    cache,
    chat,
    completions,
    files,
    health,
    message_batches,
    messages,
    models,
    responses,
    sagemaker,
    tokenize,
)
from gateway.local.adapters import Adapters
from gateway.local.build import build_adapters, vision_rebuild, vision_renderer
from gateway.local.dispatch import Dispatcher
from gateway.local.governor import LocalGovernor
from gateway.local.pauses import SessionTurns
from gateway.local.replica_set import ReplicaSet
from gateway.local.replicas import Replica
from gateway.local.retention import BreakpointLeases
from gateway.local.routing import Router
from gateway.local.supervisor import AttachSpans, Supervisor
from gateway.providers.book import ProviderCacheBook
from gateway.providers.control import Control
from gateway.providers.path import ProviderPath
from gateway.service.attachment_intake import AttachmentIntake
from gateway.service.auth import KeyRing
from gateway.service.cache import CacheService
from gateway.service.catalog import ModelCatalog, chat_targets, text_targets
from gateway.service.chat import GatewayService, ServiceParts
from gateway.service.health import Health, StoreProbe
from gateway.service.journal import Journal
from gateway.service.limits import RateLimits
from gateway.service.local import LocalChat
from gateway.service.local_completions import LocalCompletions
from gateway.service.loop import ServiceLoop
from gateway.service.provider_chat import ProviderChat
from gateway.service.shared_state import control_leads, share_key_limits, share_provider_state
from gateway.service.targets import Targets, sees
from gateway.sessions.log import SessionLog
from gateway.sessions.reconstruct import Reconstructor
from gateway.sessions.store import SessionStore
from gateway.state.bus import LocalBus, StateBus
from gateway.state.redis_bus import RedisBus
from manifest.index import LocationId

log = logging.getLogger(__name__)


async def _cancel(tasks: Sequence[asyncio.Task[None] | None]) -> None:
    """Cancel each task and wait for it to end."""
    for task in tasks:
        if task is not None and not task.done():
            task.cancel()
    for task in tasks:
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _stop_each(steps: Sequence[tuple[str, Callable[[], Awaitable[None] | None]]]) -> None:
    """Run every step of a shutdown in order: one that raises is logged and the rest still
    run (a replica that fails to stop must not leave the session log's writer unflushed)."""
    for name, step in steps:
        try:
            result = step()
            if inspect.isawaitable(result):
                await result
        except Exception:
            log.exception("stopping the %s failed; stopping the rest", name)


def _session_log(
    settings: Settings,
    replicas: Sequence[Replica],
    store: SessionStore | None = None,
    adapters: Adapters | None = None,
) -> SessionLog | None:
    """The session log over ``store`` (by default the one ``settings.session_log`` names);
    a LoRA adapter's request rebuilds with its weights as ``adapters`` loaded them."""
    cfg = settings.session_log
    if not cfg.enabled:
        return None
    if store is None:
        store = SessionStore(cfg.db_path(settings.data_dir), cfg.fsync, url=cfg.url)

    copies = ThreadCopies()  # a rebuild to verify runs on a worker thread: a copy there

    def tokenizer() -> ChatTokenizer | None:
        ready = [r.engine for r in replicas if r.engine.ready]
        return copies(ready[0].tokenizer) if ready else None

    weights = adapters.digest if adapters is not None else None
    rebuild = Reconstructor(adapter_for, tokenizer, vision_rebuild(settings), weights)
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


def _store_probes(
    settings: Settings, session_log: SessionLog | None, bus: StateBus
) -> list[StoreProbe]:
    """The shared stores readiness watches: the session log's, the state bus's."""
    probes = []
    if session_log is not None:
        grace = settings.session_log.unavailable_grace_s
        probes.append(StoreProbe("session_log", lambda: session_log.writer.failing_since, grace))
    if settings.state.url is not None:
        probes.append(
            StoreProbe("state", lambda: bus.failing_since, settings.state.unavailable_grace_s)
        )
    return probes


def dispatcher(
    settings: Settings, replicas: ReplicaSet, metrics: Metrics, turns: SessionTurns
) -> Dispatcher:
    """The local replicas' dispatcher as ``settings`` configure it; paused sessions'
    leases (``turns``) give way to live requests."""
    router = Router(settings.cache.routing, settings.cache.load_imbalance, metrics.count_routing)
    e = settings.engine
    return Dispatcher(
        replicas,
        router,
        metrics,
        max_inflight=e.max_queued_requests,
        model=settings.model_name,
        room=e.admission_room(),
        slots=e.max_num_seqs,
        first_token_guard=e.first_token_guard,
        preempt_prefills=e.preempt_prefills,
        refresh=settings.cache.refresh_predicted,
        hold_share=settings.cache.hold_max_share,
        hold_s=settings.cache.hold_s,
        prefill_slots={ENGINE_PRIORITY[p]: n for p, n in e.prefill_slots.items()},
        make_room=turns.make_room,
    )


def session_turns(settings: Settings, metrics: Metrics) -> SessionTurns:
    """Agent sessions: the replica of the last turn, KV leased across tool-call pauses."""
    return SessionTurns(
        settings.cache.retention,
        BreakpointLeases(),
        count=lambda outcome: metrics.retention.labels(outcome).inc(),
    )


def local_chat(
    settings: Settings,
    dispatcher: Dispatcher,
    turns: SessionTurns,
    governor: LocalGovernor | None = None,
) -> LocalChat:
    """The local replicas as the chat target (``turns``: the dispatcher's too)."""
    e = settings.engine
    return LocalChat(
        dispatcher,
        turns,
        BreakpointLeases(),
        governor,
        tool_parser=e.tool_parser,
        trust_chat_template=e.trust_request_chat_template,
        render_inline_chars=e.render_inline_chars,
        input_price=settings.routing.local_input_price,
        max_output_tokens=e.max_output_tokens,
        ceiling_finish=e.max_output_tokens_finish,
        adapters=build_adapters(settings, dispatcher.replica_set),
        vision=vision_renderer(settings),
        output_interval_s=e.output_interval_ms / 1000,
    )


def gateway_service(
    settings: Settings,
    local: LocalChat,
    metrics: Metrics,
    tracing: Tracing,
    limits: RateLimits,
    providers: ProviderChat | None = None,
    session_log: SessionLog | None = None,
) -> GatewayService:
    """The service core over the local chat and the hosted providers: the chat loop and
    the text loop, one journal over ``session_log``."""
    completions = LocalCompletions(local)
    journal = Journal(session_log)
    objects = session_log.store.attachments if session_log is not None else None
    intake = AttachmentIntake(settings.attachments, objects)  # images: decoded, stored
    chat = chat_targets(local, providers)
    sight = functools.partial(sees, local=local.sees)  # the local model's: a VLM's images
    loop = ServiceLoop(journal, metrics, chat, intake, settings.routing, can_see=sight)
    text = text_targets(completions)  # text prompts carry no attachments: intake is idle
    text_loop = ServiceLoop(journal, metrics, text, intake, settings.routing)
    local_name = settings.model_name if local.dispatcher.replicas else None
    targets = Targets(local_name, settings.aliases, list(settings.providers))
    catalog = ModelCatalog(local, targets, settings.model_name)
    parts = ServiceParts(
        local,
        completions,
        loop,
        text_loop,
        catalog,
        limits,
        metrics,
        tracing,
        providers,
        session_log,
    )
    return GatewayService(parts)


@dataclass(frozen=True)
class Gateway:
    """Everything ``create_app`` built, for the lifespan to start and stop."""

    settings: Settings
    metrics: Metrics
    tracing: Tracing
    bus: StateBus
    dispatcher: Dispatcher
    supervisor: Supervisor
    service: GatewayService
    keyring: KeyRing
    cache: CacheService
    providers: ProviderPath | None
    control: Control
    governor: LocalGovernor | None
    session_log: SessionLog | None
    grpc: list[GrpcServer]  # the gRPC server, while the lifespan runs one
    batches: BatchRunner  # the batch APIs' runner, over its store


def lifespan(g: Gateway) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """Start what ``g`` runs (the state bus, the gRPC server, the replicas in a tracked
    task, the control loops, the session log's retention), and stop it all in order."""

    @contextlib.asynccontextmanager
    async def span(app: FastAPI) -> AsyncIterator[None]:
        settings, service, supervisor = g.settings, g.service, g.supervisor
        g.metrics.watch_engines(g.dispatcher.replica_stats)
        grpc_server = None
        if settings.grpc_port is not None:
            servicer = GatewayServicer(service, g.keyring, g.cache)
            grpc_server = GrpcServer(
                servicer,
                settings.host,
                settings.grpc_port,
                settings.max_request_body_bytes,
                reuse_port=settings.workers > 1,
            )
            await grpc_server.start()
            g.grpc.append(grpc_server)  # the supervisor's changes reach its health now
        app.state.grpc = grpc_server

        watch = LoopWatch(
            asyncio.get_running_loop(),
            g.metrics.loop_lag.observe,
            lambda generation, s: g.metrics.gc_pause.labels(str(generation)).observe(s),
        )
        watch.start()

        async def boot() -> None:
            await supervisor.boot()
            with watch.expected():  # one full collection, then the collector skips it all
                frozen = freeze_startup_heap()
            log.info("froze the startup heap: %d objects out of the collector's passes", frozen)
            if service.ready:
                port = grpc_server.port if grpc_server is not None else None
                log.info("%s", banner(settings, service, port))

        await g.bus.start()
        starting = asyncio.create_task(boot(), name="engine-start")
        steering = []
        if g.providers is not None and g.control.enabled:
            warm = service.warm_provider
            steering.append(asyncio.create_task(g.control.run(warm), name="provider-control"))
        if g.governor is not None:
            steering.append(asyncio.create_task(g.governor.run(), name="local-governor"))
        retention = None
        if g.session_log is not None and settings.worker_index == 0:  # one worker retains
            retention = asyncio.create_task(
                _retain_forever(settings, g.session_log), name="session-retention"
            )
        batch_runner = asyncio.create_task(g.batches.run(), name="batch-runner")

        async def stop_grpc() -> None:
            if grpc_server is not None:
                g.grpc.remove(grpc_server)
                await grpc_server.stop(grace_s=5)

        async def close_providers() -> None:
            if g.providers is not None:
                await g.providers.close()

        def close_session_log() -> None:
            if g.session_log is not None:
                g.session_log.close()  # its writer commits what it was handed first

        try:
            yield
        finally:
            tasks = (retention, batch_runner, *steering, starting)
            await _stop_each(
                [
                    ("tasks", functools.partial(_cancel, tasks)),
                    ("grpc", stop_grpc),
                    ("replicas", supervisor.close),
                    ("service", service.close),
                    ("state bus", g.bus.close),
                    ("loop watch", watch.stop),
                    ("providers", close_providers),
                    ("session log", close_session_log),
                    ("batch store", g.batches.store.close),
                    ("batch runner", g.batches.aclose),
                    ("tracing", g.tracing.shutdown),
                ]
            )

    return span


def create_app(
    settings: Settings,
    built: Sequence[Replica | Engine],
    provider_clock: Callable[[], float] = time.monotonic,
    tracing: Tracing | None = None,
    provider_transport: Transport | None = None,
    attach_spans: AttachSpans | None = None,
    session_store: SessionStore | None = None,
) -> FastAPI:
    """An app over ``built`` replicas (bare engines become replicas without KV events) and,
    when ``settings.providers`` names any, the hosted providers (TTLs on ``provider_clock``;
    ``provider_transport``: how requests reach them, aiohttp by default).
    ``attach_spans``: the exact KV spans over the started replicas (by default, those
    that publish KV events: :meth:`Supervisor.attach_spans`); ``session_store``: the
    session log's store (by default the one ``settings.session_log`` names).

    The one composition root: every collaborator is built here, in dependency order, and
    handed to the constructors of those that use it."""
    metrics = Metrics(os.environ.get(MULTIPROC_ENV) if settings.workers > 1 else None)
    tracing = tracing or Tracing(settings.otlp_endpoint)
    if settings.control.clock_scale != 1.0:  # a load test against a time-scaled emulator
        provider_clock = _scaled(provider_clock, settings.control.clock_scale)
    bus = _state_bus(settings)

    # the hosted providers: what this gateway learns goes out on the bus
    control = Control(
        settings.control,
        provider_clock,
        publish=bus.publish,
        leads=control_leads(bus),
        retention=settings.cache.retention,
        claim=bus.claim,
    )
    providers = None
    if settings.providers:
        book = ProviderCacheBook(provider_clock, publish=bus.publish)
        providers = ProviderPath(
            settings,
            metrics,
            provider_clock,
            transport=provider_transport,
            book=book,
            control=control,
        )
        share_provider_state(bus, providers, control, settings.control.clock_scale)
    provider_chat = (
        ProviderChat(providers, settings.prompt_layout, metrics) if providers is not None else None
    )

    # the local replicas: one set the supervisor writes and the dispatcher reads
    replicas = ReplicaSet(
        [
            b if isinstance(b, Replica) else Replica(LocationId(f"replica-{i}"), b)
            for i, b in enumerate(built)
        ]
    )
    turns = session_turns(settings, metrics)
    local_dispatcher = dispatcher(settings, replicas, metrics, turns)
    governor = None
    if settings.control.mode == "govern" and replicas.replicas:
        governor = LocalGovernor(
            settings.control, lambda: replicas.kv, settings.cache.pin_max_share
        )
    local = local_chat(settings, local_dispatcher, turns, governor)

    # the service core, its session log and the key limits (shared on the bus)
    session_log = _session_log(settings, replicas.replicas, session_store, local.adapters)
    limits = RateLimits(publish=bus.publish)
    share_key_limits(bus, limits)
    service = gateway_service(settings, local, metrics, tracing, limits, provider_chat, session_log)
    cache_ops = CacheService(
        local,
        settings.model_name,
        service.targets,
        provider_chat,
        service.warm_provider,
        service.warm_local,
        service.loop.intake,
    )

    # supervision: readiness changes reach the gRPC server's health while one runs
    grpc_servers: list[GrpcServer] = []

    async def health_changed() -> None:
        for server in grpc_servers:
            await server.set_serving(service.ready)

    supervisor = Supervisor(
        replicas,
        local_dispatcher,
        pin_max_share=settings.cache.pin_max_share,
        default_lease_s=settings.cache.default_lease_s,
        on_change=health_changed,
        poll_s=settings.engine.watch_interval_s,
        backoff_base_s=settings.engine.restart_backoff_s,
        backoff_cap_s=settings.engine.restart_backoff_cap_s,
        instance_id=settings.instance_id,
        attach_spans=attach_spans,
    )
    keyring = KeyRing(settings.api_keys)
    log_cfg = settings.session_log  # batches live on the session log's database
    batch_store = BatchStore.beside(log_cfg.db_path(settings.data_dir), log_cfg.fsync, log_cfg.url)
    runs = settings.batches
    # a batch model's hosted targets, for the provider plan (online against their batch API)
    batch_targets = BatchTargets(
        service.targets.resolve,
        providers.target if providers is not None else None,
        settings.providers,
        HitShares(batch_store),  # measured on finished provider batches, kept in the store
    )
    # batches go to a provider's batch API where the plan finds it cheaper; submissions kept
    # before a restart are followed (or their items ended by name) even with that off now
    provider_batches = ProviderBatches(
        service,
        BatchAPIClient(provider_transport, runs.provider_poll_s),
        batch_targets.endpoint,
        batch_targets.batch_api if runs.provider_api and providers is not None else None,
        batch_targets.learn,
    )
    batch_runner = BatchRunner(
        batch_store,
        ServiceSender(service),
        concurrency=runs.concurrency,
        lease_s=runs.lease_s,
        poll_s=runs.poll_s,
        pins=CachePins(cache_ops),
        recall=default_gate() if runs.recall else None,
        metrics=metrics,
        provider=provider_batches,
    )
    gateway = Gateway(
        settings,
        metrics,
        tracing,
        bus,
        local_dispatcher,
        supervisor,
        service,
        keyring,
        cache_ops,
        providers,
        control,
        governor,
        session_log,
        grpc_servers,
        batch_runner,
    )

    # the edges
    app = FastAPI(
        title="vcache", version=str(version_info()["version"]), lifespan=lifespan(gateway)
    )
    state = app.state  # what the routes read (request.app.state), built above
    state.settings = settings
    state.bus = bus
    state.metrics = metrics
    state.supervisor = supervisor
    state.keyring = keyring
    state.providers = providers
    state.control = control
    state.session_log = session_log
    state.service = service
    state.local_governor = governor
    state.cache = cache_ops
    state.health = Health(supervisor, service, _store_probes(settings, session_log, bus))
    state.server_load = ServerLoad()
    state.batches, state.batch_runner = batch_store, batch_runner
    state.batch_targets = batch_targets
    install_error_handlers(app, metrics)
    install_openapi(app)
    routers = (health, models, chat, completions, responses, messages, cache, tokenize)
    for r in (m.router for m in (*routers, files, batches, message_batches, sagemaker)):
        app.include_router(r)
    # innermost: the hot routes past FastAPI's router, inside the body limit and metrics
    direct = {
        ("POST", "/v1/chat/completions"): chat.chat_direct,
        ("POST", "/v1/completions"): completions.completion_direct,
        ("POST", "/v1/responses"): responses.response_direct,
        ("POST", "/v1/messages"): messages.message_direct,
    }
    app.add_middleware(DirectRoutes, routes=direct)
    app.add_middleware(
        BodyLimitMiddleware,
        limit=settings.max_request_body_bytes,
        metrics=metrics,
        chunk_timeout_s=settings.http.body_timeout_s,
        path_limits=dict.fromkeys(UPLOAD_PATHS, settings.batches.max_upload_bytes),
    )
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics, load=state.server_load)
    return app
