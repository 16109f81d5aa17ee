"""Replica supervision: start the local replicas, notice one that dies, restart it.

::

    starting ──start ok──▶ ready ──engine died──▶ dead ──backoff──▶ restarting
        │                    ▲                                          │
        └──start failed──▶ failed                 ready ◀──start ok─────┤
                                                  dead  ◀──start failed─┘

At boot every replica is started one at a time (each engine sizes its memory
on start), then the KV-span manager attaches to those that publish KV events
and probes them.  A boot failure is final (``failed``: a bad model path or a
bad config; ``/healthz`` turns 503 so an orchestrator restarts the gateway).

After boot a watcher polls each replica's ``ready``.  A replica whose engine
died (the engine core process exited, vLLM's monitor marked it dead) is
``dead``: the dispatcher no longer routes to it, its KV index and pins are
dropped, and it is restarted with exponential backoff from its factory.  A
restarted replica is reattached to the KV manager (fresh subscriber, resync,
probe) before it is ``ready`` again.  Meanwhile requests go to the other
replicas; with none left, the local target is unavailable (503 with the time
until the next attempt as ``Retry-After``) and aliases fall back.

What it learns it writes to the :class:`~gateway.local.replica_set.ReplicaSet` it
is built with (the boot's outcome, each replica's health, a restarted engine); the
dispatcher and the local chat read the same set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import cast

from engines.base import Engine
from gateway.local.dispatch import Dispatcher
from gateway.local.replica_set import ReplicaHealth, ReplicaSet
from gateway.local.replicas import Replica
from gateway.local.spans import CoreControlled, KVSpans
from manifest.index import LocationId

log = logging.getLogger(__name__)

HASH_ALGO = "sha256_cbor"  # what manifest.hashing computes
PROBE_TEXT = "vcache probe: the manifest must hash blocks exactly as the engine does. "

# the exact KV spans over the started replicas (None: none publishes KV events)
AttachSpans = Callable[[Sequence[Replica]], Awaitable[KVSpans | None]]


def backoff_s(failures: int, base_s: float, cap_s: float) -> float:
    """Delay before restart attempt number ``failures`` (0-based): base, 2x, 4x ... capped."""
    return float(min(cap_s, base_s * (2 ** min(failures, 30))))


class Supervisor:
    def __init__(
        self,
        replicas: ReplicaSet,
        dispatcher: Dispatcher,
        *,
        pin_max_share: float,
        default_lease_s: float,
        on_change: Callable[[], Awaitable[None]] | None = None,
        poll_s: float = 1.0,
        backoff_base_s: float = 1.0,
        backoff_cap_s: float = 60.0,
        instance_id: str = "",
        attach_spans: AttachSpans | None = None,
    ) -> None:
        """``replicas``: the set it starts, restarts and marks (the dispatcher reads
        it); ``on_change``: told after each change of the replicas' readiness;
        ``attach_spans``: the KV spans over the started replicas (by default those that
        publish KV events, as their capabilities declare: :meth:`attach_spans`)."""
        self.replicas = replicas
        self._dispatcher = dispatcher  # its touches under way end before the spans close
        self._kv_args = (pin_max_share, default_lease_s)
        self._instance_id = instance_id  # this gateway's holds on the engines' pins
        self._on_change = on_change
        self._poll_s = poll_s
        self._backoff = (backoff_base_s, backoff_cap_s)
        self._clock = replicas.clock
        self._attach = attach_spans or self.attach_spans
        self._start_s = 0.0  # the longest engine start seen: how long a restart takes
        self._watch: asyncio.Task[None] | None = None

    # ------------------------------------------------------------- view

    @property
    def health(self) -> dict[LocationId, ReplicaHealth]:
        return self.replicas.health

    @property
    def kv(self) -> KVSpans | None:
        return self.replicas.kv

    @property
    def boot_failure(self) -> str | None:
        """Why the replicas could not start at boot (the dispatcher refuses requests
        with it)."""
        return self.replicas.failed

    @property
    def engine_dead(self) -> bool:
        """Every local replica has died after boot (none can serve until one restarts)."""
        return self.replicas.engine_dead

    def retry_after_s(self) -> float:
        """How long until a dead local engine may serve again (at least 1 s)."""
        return self.replicas.retry_after_s()

    def report(self) -> dict[str, dict[str, object]]:
        return {
            r: {"state": h.state, "restarts": h.restarts, "last_error": h.last_error}
            for r, h in self.health.items()
        }

    # ------------------------------------------------------------- boot

    async def boot(self) -> None:
        """Start every replica, attach KV tracking, then watch.  Never raises: a failure
        is recorded in ``boot_failure`` and the replica states."""
        try:
            n = len(self.replicas.replicas)
            for i, b in enumerate(self.replicas.replicas, 1):
                log.info("starting replica %s (%d of %d): loading the model", b.id, i, n)
                t0 = self._clock()
                await b.engine.start()
                self._start_s = max(self._start_s, self._clock() - t0)
                self.health[b.id].state = "ready"
                log.info("replica %s ready in %.1f s", b.id, self._clock() - t0)
            self.replicas.booted(await self._attach(self.replicas.replicas))
        except Exception as exc:
            log.exception("engine failed to start")
            self.replicas.boot_failed(f"{type(exc).__name__}: {exc}")
            return
        await self._changed()
        self._watch = asyncio.create_task(self._watch_forever(), name="replica-watch")

    async def attach_spans(self, replicas: Sequence[Replica]) -> KVSpans | None:
        """Exact spans over the replicas that publish KV events, run the vcache plugin and
        hash blocks as the manifest does (their declared capabilities say so)."""
        tracked = []
        for r in replicas:
            caps = r.engine.capabilities
            if r.events_endpoint and caps.span_control and caps.hash_algo == HASH_ALGO:
                tracked.append(r)
            elif r.events_endpoint:
                log.warning(
                    "replica %s: no exact spans (hash %s, span control %s)",
                    r.id,
                    caps.hash_algo,
                    caps.span_control,
                )
        if not tracked:
            return None
        first = tracked[0].engine.capabilities
        seeds = {r.engine.capabilities.hash_seed for r in tracked}
        if len(seeds) != 1 or first.hash_seed is None:
            raise ValueError(f"replicas must share one declared hash seed, not {seeds}")
        share, lease = self._kv_args
        kv = KVSpans(
            block_size=first.block_size,
            hash_seed=first.hash_seed,
            pin_max_share=share,
            default_lease_s=lease,
            holder=self._instance_id,
        )
        for r in tracked:
            assert r.events_endpoint is not None  # filtered above
            kv.attach(r.id, cast(CoreControlled, r.engine), r.events_endpoint, r.replay_endpoint)
        await kv.start(self.probe_tokens(tracked[0].engine))
        return kv

    def probe_tokens(self, engine: Engine) -> list[int]:
        """Two blocks and a token, or as many as the context allows (one block at least)."""
        caps = engine.capabilities
        n = min(2 * caps.block_size + 1, caps.max_model_len - 1)
        return engine.tokenizer.encode(PROBE_TEXT * 64)[:n]

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self._dispatcher.settle()  # touches under way end before the spans close
        if self.kv is not None:
            await self.kv.close()
        for r in self.replicas.replicas:
            await r.engine.close()

    # ------------------------------------------------------------ watch

    async def _watch_forever(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            await self.check()

    async def check(self) -> None:
        """One pass: notice replicas that died, restart those whose backoff has passed."""
        for replica in self.replicas.replicas:
            rid = replica.id
            h = self.health[rid]
            if h.state == "ready" and not replica.engine.ready:
                await self._died(rid, h)
            due = h.next_attempt_at is not None and self._clock() >= h.next_attempt_at
            if h.state == "dead" and due:
                await self._restart(rid, h)

    async def _died(self, rid: LocationId, h: ReplicaHealth) -> None:
        log.error("replica %s: engine died; restarting it", rid)
        h.state, h.last_error = "dead", "the engine process died"
        h.next_attempt_at = self._clock() + backoff_s(h.failures, *self._backoff)
        if self.kv is not None and rid in self.kv.replicas:
            self.kv.detach(rid)
        with contextlib.suppress(Exception):
            await self._replica(rid).engine.close()
        if self._replica(rid).factory is None:
            h.next_attempt_at = None  # a bare engine: nothing to restart it from
        await self._changed()

    async def _restart(self, rid: LocationId, h: ReplicaHealth) -> None:
        factory = self._replica(rid).factory
        assert factory is not None  # dead replicas without one have no next attempt
        h.state = "restarting"
        h.next_attempt_at = self._clock() + self._start_s  # when it should serve again
        engine = factory()
        try:
            await engine.start()
            if self.kv is not None and rid in self.kv.replicas:
                control = cast(CoreControlled, engine)
                await self.kv.reattach(rid, control, self.probe_tokens(engine))
        except Exception as exc:
            with contextlib.suppress(Exception):
                await engine.close()
            h.failures += 1
            h.state, h.last_error = "dead", f"restart failed: {type(exc).__name__}: {exc}"
            h.next_attempt_at = self._clock() + backoff_s(h.failures, *self._backoff)
            log.exception("replica %s: restart failed (attempt %d)", rid, h.failures)
            return
        self.replicas.swap(rid, engine)
        h.state, h.failures, h.next_attempt_at = "ready", 0, None
        h.restarts += 1
        log.info("replica %s: restarted and ready (%d restarts)", rid, h.restarts)
        await self._changed()

    def _replica(self, rid: LocationId) -> Replica:
        r = self.replicas.replica(rid)
        assert r is not None  # the supervisor walks its own set
        return r

    async def _changed(self) -> None:
        if self._on_change is not None:
            await self._on_change()
