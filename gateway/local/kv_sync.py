"""The manifest's index kept in step with each replica's KV events.

One :class:`KVSync` per gateway: for every replica that speaks the vcache
engine-core plugin it runs a subscriber, folds its ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared`` events into one :class:`PrefixIndex`
(location = replica id), repairs gaps by replay or a full resync from the
engine, and answers :meth:`sync`: every event the replicas published so far
is in the index (with ``barrier``, exactly up to what each engine says it sent).
A cleared cache drops the replica's leases from the :class:`LeaseBook`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from engines.base import GenerateRequest
from engines.errors import EngineError
from engines.vllm.kv_events import (
    AllBlocksCleared,
    BlockStored,
    EventBatch,
    KVEventSubscriber,
)
from engines.vllm.span_control import SpanControl
from gateway.local.leases import LeaseBook
from manifest.hashing import BlockHash
from manifest.index import Change, LocationId, PrefixIndex

log = logging.getLogger(__name__)

Agreement = Literal["unknown", "exact", "approximate"]
MAX_ANSWERED = 1024  # per replica between two syncs; past it, answers are not tracked


class CoreControlled(Protocol):
    """An engine whose core runs the vcache plugin (see engines/vllm/plugin.py)."""

    async def call_core(self, method: str, *args: Any) -> Any: ...

    def generate(self, request: GenerateRequest) -> Any: ...


@dataclass
class ReplicaCacheState:
    replica: LocationId
    engine: CoreControlled
    subscriber: KVEventSubscriber
    events_endpoint: str
    replay_endpoint: str | None
    agreement: Agreement = "unknown"
    live: bool = True  # False between the engine's death and its restart
    predictions_matched: int = 0
    predictions_missed: int = 0
    # Last full-block hash of each prompt the engine has answered since the last sync:
    # its BlockStored events were sent before the answer, but may still be in transit.
    answered: list[BlockHash] = field(default_factory=list)
    late_event_waits: int = 0  # syncs that had to wait for such events
    # False while the engine core cannot be asked which events it sent (its control
    # endpoint is down): the index may lag it, so its predictions are not exact.
    synced: bool = True
    sync_failures: int = 0
    num_blocks: int | None = None  # the engine's KV blocks, once asked
    num_blocks_retry_at: float = 0.0  # not asked again before (it could not answer)

    @property
    def control(self) -> SpanControl:
        """The engine core's span control (pin, unpin, evict, barrier...), typed."""
        return SpanControl(self.engine)


class KVSync:
    def __init__(self, index: PrefixIndex, leases: LeaseBook) -> None:
        self.index = index
        self._leases = leases
        self._replicas: dict[LocationId, ReplicaCacheState] = {}
        self._subscribers: dict[LocationId, asyncio.Task[None]] = {}
        # The index's events, drained after every change and counted (its queue stays empty).
        self.index_events: Counter[tuple[LocationId, str]] = Counter()

    # ---------------------------------------------------------- replicas

    def attach(
        self,
        replica: LocationId,
        engine: CoreControlled,
        events_endpoint: str,
        replay_endpoint: str | None,
    ) -> None:
        self.index.add_location(replica)
        sub = self._subscriber(replica, events_endpoint, replay_endpoint)
        self._replicas[replica] = ReplicaCacheState(
            replica, engine, sub, events_endpoint, replay_endpoint
        )

    def _subscriber(
        self, replica: LocationId, events_endpoint: str, replay_endpoint: str | None
    ) -> KVEventSubscriber:
        def apply(batch: EventBatch) -> None:
            self.apply(replica, batch)

        async def resync() -> None:
            await self.resync(replica)

        return KVEventSubscriber(events_endpoint, replay_endpoint, apply, resync)

    def start(self) -> None:
        for st in self._replicas.values():
            self._listen(st)

    def _listen(self, st: ReplicaCacheState) -> None:
        task = asyncio.create_task(st.subscriber.run(), name=f"kv-{st.replica}")
        self._subscribers[st.replica] = task

    def detach(self, replica: LocationId) -> None:
        """The replica's engine died: stop listening and forget what it held and pinned."""
        st = self._replicas[replica]
        st.live, st.agreement = False, "unknown"
        task = self._subscribers.pop(replica, None)
        if task is not None:
            task.cancel()
        st.subscriber.close()
        self.index.apply_cleared(replica)
        self._drop_leases(replica)
        self.drain()

    async def reattach(self, replica: LocationId, engine: CoreControlled) -> None:
        """A restarted engine for ``replica``: a fresh subscriber (its event sequence starts
        again) and the index rebuilt from the engine."""
        st = self._replicas[replica]
        st.engine = engine
        st.subscriber = self._subscriber(replica, st.events_endpoint, st.replay_endpoint)
        self._listen(st)
        await self.resync(replica)
        st.live = True

    async def close(self) -> None:
        tasks = list(self._subscribers.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._subscribers.clear()
        for st in self._replicas.values():
            if st.live:
                st.subscriber.close()

    @property
    def replicas(self) -> list[LocationId]:
        return list(self._replicas)

    def state(self, replica: LocationId) -> ReplicaCacheState:
        return self._replicas[replica]

    def states(self) -> list[ReplicaCacheState]:
        return list(self._replicas.values())

    # ------------------------------------------------------------ events

    def drain(self) -> None:
        for ev in self.index.take_events():
            self.index_events[(ev.location, ev.kind)] += ev.blocks

    def apply(self, replica: LocationId, batch: EventBatch) -> None:
        """Fold one batch (an engine step's events): its stores and removals in one
        :meth:`PrefixIndex.apply_changes` between any two cache clears."""
        changes: list[Change] = []
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                if changes:
                    self.index.apply_changes(replica, changes)
                    changes = []
                self.index.apply_cleared(replica)
                self._drop_leases(replica)
            else:
                changes.append((isinstance(ev, BlockStored), ev.block_hashes))
        if changes:
            self.index.apply_changes(replica, changes)
        self.drain()

    async def resync(self, replica: LocationId) -> None:
        """Rebuild one replica's index from the engine's own view of its cache."""
        resident = await self._replicas[replica].control.resident()
        self.index.apply_cleared(replica)
        self._drop_leases(replica)  # a restarted engine holds no pins: owners must pin again
        self.index.apply_stored(replica, [BlockHash(bytes(h)) for h in resident])
        self.drain()
        log.info("replica %s: index resynced, %d blocks resident", replica, len(resident))

    def _drop_leases(self, replica: LocationId) -> None:
        lost = self._leases.drop(replica)
        if lost:
            log.warning("replica %s: %d pinned blocks lost (cache cleared)", replica, lost)

    def answered(self, replica: LocationId, hashes: Sequence[BlockHash]) -> None:
        """The engine answered a prompt with these full blocks (its first output arrived):
        it has stored them, and the next :meth:`sync` makes sure the index has seen that."""
        st = self._replicas.get(replica)
        if st is not None and hashes and len(st.answered) < MAX_ANSWERED:
            st.answered.append(hashes[-1])

    async def sync(self, barrier: bool = False) -> None:
        """Fold every event the replicas have published so far.

        With ``barrier`` each engine is asked which batch it sent last and the
        subscriber waits for it: exact even for the request that just finished
        (one round trip per replica; admin operations use it).  Without it
        (dispatch), a replica whose answered prompts are not all in the index yet
        gets the barrier: their events are still on the wire, and a client that
        sends the next turn at once must be predicted against them.
        """
        for st in self._replicas.values():
            if not st.live:
                continue
            if barrier:  # an admin operation: a replica that cannot answer is an error
                await self.barrier(st)
                st.synced = True
            else:
                await st.subscriber.sync()
                if st.answered and not self._all_seen(st):
                    st.late_event_waits += 1
                    await self._dispatch_barrier(st)
            st.answered.clear()

    async def _dispatch_barrier(self, st: ReplicaCacheState) -> None:
        """The barrier a request's routing needs.  A replica whose engine core cannot be
        asked (its control endpoint is down) does not fail the request: it is predicted
        from the events seen so far and marked not exact until a barrier succeeds."""
        try:
            await self.barrier(st)
        except EngineError as exc:
            st.synced, st.sync_failures = False, st.sync_failures + 1
            log.warning(
                "replica %s: KV events barrier failed (%s); predictions there are "
                "not exact until it answers",
                st.replica,
                exc,
            )
            return
        st.synced = True

    def _all_seen(self, st: ReplicaCacheState) -> bool:
        return all(self.index.match([h])[st.replica] for h in st.answered)

    async def barrier(self, st: ReplicaCacheState) -> None:
        seq = await st.control.barrier()
        if not await st.subscriber.wait_for(seq):
            log.warning("replica %s: KV events up to %s not seen in time", st.replica, seq)
