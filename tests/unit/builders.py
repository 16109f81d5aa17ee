"""The gateway's parts as the unit tests build them: through the same constructors and
composition functions as ``gateway/app.py`` (the one composition root), never by
assigning onto a built object."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.app import gateway_service, local_chat, session_turns
from gateway.core.config import AttachmentSettings, RoutingSettings, Settings
from gateway.core.metrics import Metrics
from gateway.core.tracing import Tracing
from gateway.local.dispatch import Dispatcher
from gateway.local.pauses import SessionTurns
from gateway.local.replica_set import ReplicaSet
from gateway.local.replicas import Replica
from gateway.local.routing import Router
from gateway.local.spans import KVSpans
from gateway.service.attachment_intake import AttachmentIntake
from gateway.service.chat import GatewayService
from gateway.service.journal import Journal
from gateway.service.limits import RateLimits
from gateway.service.local import LocalChat
from gateway.service.loop import Resolve, ServiceLoop
from gateway.sessions.log import SessionLog
from tests.settings import gateway_settings


def booted(replicas: Sequence[Replica], kv: KVSpans | None = None) -> ReplicaSet:
    """``replicas`` as the supervisor leaves them after a boot that went through, with
    ``kv`` the spans it attached (None: none)."""
    rs = ReplicaSet(replicas)
    rs.booted(kv)
    return rs


def turns(metrics: Metrics, settings: Settings | None = None) -> SessionTurns:
    return session_turns(settings or gateway_settings(), metrics)


def dispatcher(
    replicas: ReplicaSet,
    metrics: Metrics,
    turns: SessionTurns | None = None,
    router: Router | None = None,
    **options: Any,
) -> Dispatcher:
    """A dispatcher over ``replicas`` (``options``: the constructor's, ``max_inflight`` 4
    unless given); paused sessions' leases (``turns``) give way to its live requests."""
    make_room = turns.make_room if turns is not None else None
    options = {"max_inflight": 4, **options}
    return Dispatcher(replicas, router or Router(), metrics, make_room=make_room, **options)


def local(
    dispatcher: Dispatcher, turns: SessionTurns, settings: Settings | None = None
) -> LocalChat:
    return local_chat(settings or gateway_settings(), dispatcher, turns)


def service(
    replicas: ReplicaSet,
    metrics: Metrics | None = None,
    log: SessionLog | None = None,
    settings: Settings | None = None,
    **options: Any,
) -> GatewayService:
    """The service core over one dispatcher on ``replicas`` (``options``: the
    dispatcher's), its session log ``log``, as ``gateway/app.py`` composes it."""
    settings = settings or gateway_settings()
    metrics = metrics or Metrics()
    t = turns(metrics, settings)
    d = dispatcher(replicas, metrics, t, **options)
    chat = local_chat(settings, d, t)
    return gateway_service(settings, chat, metrics, Tracing(), RateLimits(), session_log=log)


def loop(
    journal: Journal,
    metrics: Metrics,
    resolve: Resolve,
    routing: RoutingSettings | None = None,
    intake: AttachmentIntake | None = None,
) -> ServiceLoop:
    """A service loop over ``resolve``'s targets; ``intake`` by default the default bounds
    over the journal's log's attachments store (as ``gateway/app.py`` builds it)."""
    if intake is None:
        store = journal.log.store.attachments if journal.log is not None else None
        intake = AttachmentIntake(AttachmentSettings(), store)
    return ServiceLoop(journal, metrics, resolve, intake, routing)
