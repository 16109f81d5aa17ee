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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, cast

from engines.base import Engine
from gateway.local.dispatch import Dispatcher
from gateway.local.spans import CoreControlled, KVSpans
from manifest.index import LocationId

log = logging.getLogger(__name__)

ReplicaState = Literal["starting", "ready", "dead", "restarting", "failed"]
HASH_ALGO = "sha256_cbor"  # what manifest.hashing computes
PROBE_TEXT = "vcache probe: the manifest must hash blocks exactly as the engine does. "


@dataclass
class ReplicaHealth:
    state: ReplicaState = "starting"
    restarts: int = 0  # successful restarts since boot
    failures: int = 0  # consecutive failed restart attempts
    last_error: str | None = None
    next_attempt_at: float | None = None  # monotonic time of the next restart attempt


def backoff_s(failures: int, base_s: float, cap_s: float) -> float:
    """Delay before restart attempt number ``failures`` (0-based): base, 2x, 4x ... capped."""
    return float(min(cap_s, base_s * (2 ** min(failures, 30))))


class Supervisor:
    def __init__(
        self,
        dispatcher: Dispatcher,
        *,
        pin_max_share: float,
        default_lease_s: float,
        on_change: Callable[[], Awaitable[None]] | None = None,
        poll_s: float = 1.0,
        backoff_base_s: float = 1.0,
        backoff_cap_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        instance_id: str = "",
    ) -> None:
        self._dispatcher = dispatcher
        self._replicas = {r.id: r for r in dispatcher.replicas}
        self._kv_args = (pin_max_share, default_lease_s)
        self._instance_id = instance_id  # this gateway's holds on the engines' pins
        self.on_change = on_change
        self._poll_s = poll_s
        self._backoff = (backoff_base_s, backoff_cap_s)
        self._clock = clock
        self.health: dict[LocationId, ReplicaHealth] = {r: ReplicaHealth() for r in self._replicas}
        self.kv: KVSpans | None = None
        self._start_s = 0.0  # the longest engine start seen: how long a restart takes
        self._watch: asyncio.Task[None] | None = None
        dispatcher.retry_after_s = self.retry_after_s

    # ------------------------------------------------------------- view

    @property
    def boot_failure(self) -> str | None:
        """Why the replicas could not start at boot (kept by the dispatcher, which refuses
        requests with it)."""
        return self._dispatcher.failed

    @property
    def engine_dead(self) -> bool:
        """Every local replica has died after boot (none can serve until one restarts)."""
        return bool(self.health) and all(
            h.state in ("dead", "restarting") for h in self.health.values()
        )

    def retry_after_s(self) -> float:
        """How long until a dead local engine may serve again (at least 1 s): the next
        restart attempt, or the end of the one under way (as long as a boot start took)."""
        at = [h.next_attempt_at for h in self.health.values() if h.next_attempt_at is not None]
        return max(1.0, min(at) - self._clock()) if at else 5.0

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
            n = len(self._replicas)
            for i, b in enumerate(self._replicas.values(), 1):
                log.info("starting replica %s (%d of %d): loading the model", b.id, i, n)
                t0 = self._clock()
                await b.engine.start()
                self._start_s = max(self._start_s, self._clock() - t0)
                self.health[b.id].state = "ready"
                log.info("replica %s ready in %.1f s", b.id, self._clock() - t0)
            self.kv = await self._attach_kv()
            self._dispatcher.kv = self.kv
            self._dispatcher.started = True
        except Exception as exc:
            log.exception("engine failed to start")
            self._dispatcher.failed = f"{type(exc).__name__}: {exc}"
            for h in self.health.values():
                h.state = "failed"
            return
        await self._changed()
        self._watch = asyncio.create_task(self._watch_forever(), name="replica-watch")

    async def _attach_kv(self) -> KVSpans | None:
        """Exact spans over the replicas that publish KV events, run the vcache plugin and
        hash blocks as the manifest does (their declared capabilities say so)."""
        tracked = []
        for r in self._replicas.values():
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
        for r in self._replicas.values():
            await r.engine.close()

    # ------------------------------------------------------------ watch

    async def _watch_forever(self) -> None:
        while True:
            await asyncio.sleep(self._poll_s)
            await self.check()

    async def check(self) -> None:
        """One pass: notice replicas that died, restart those whose backoff has passed."""
        for rid, replica in self._replicas.items():
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
            await self._replicas[rid].engine.close()
        if self._replicas[rid].factory is None:
            h.next_attempt_at = None  # a bare engine: nothing to restart it from
        await self._changed()

    async def _restart(self, rid: LocationId, h: ReplicaHealth) -> None:
        factory = self._replicas[rid].factory
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
        self._replicas[rid].engine = engine
        h.state, h.failures, h.next_attempt_at = "ready", 0, None
        h.restarts += 1
        log.info("replica %s: restarted and ready (%d restarts)", rid, h.restarts)
        await self._changed()

    async def _changed(self) -> None:
        if self.on_change is not None:
            await self.on_change()
