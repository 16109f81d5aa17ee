"""Exact KV spans on local vLLM replicas: the manifest's index kept in step with each engine.

For every replica that speaks the vcache engine-core plugin, the manager

- subscribes to its KV events and folds them into one :class:`PrefixIndex`
  (location = replica id), repairing gaps by replay or full resync;
- probes it at start: the hashes of a probe prompt in its ``BlockStored``
  events must equal :func:`manifest.hashing.block_hashes`; a replica that
  disagrees is *approximate* and its predictions are not reported as exact;
- predicts, before dispatch, how many prompt tokens each replica will serve
  from cache, and counts whether vLLM's ``num_cached_tokens`` agreed;
- pins, unpins and evicts spans by hash.  Every pin has an owner and a lease;
  the engine holds one reference per block while any owner's lease is live,
  and a reaper releases expired leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from engines.base import GenerateRequest, SamplingOptions
from engines.errors import EngineError
from engines.vllm.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventSubscriber,
)
from engines.vllm.span_control import SpanControl
from gateway.local.leases import Lease, LeaseBook
from manifest.hashing import BlockHash, HashKeys, block_hashes
from manifest.index import LocationId, PrefixIndex

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

    @property
    def control(self) -> SpanControl:
        """The engine core's span control (pin, unpin, evict, barrier...), typed."""
        return SpanControl(self.engine)


@dataclass
class PinResult:
    replica: LocationId
    pinned: list[str] = field(default_factory=list)  # hex hashes held for this owner now
    missing: list[str] = field(default_factory=list)  # not resident: nothing to pin
    refused: list[str] = field(default_factory=list)  # over the pin budget


class KVSpans:
    def __init__(
        self,
        block_size: int,
        hash_seed: str,
        pin_max_share: float,
        default_lease_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.index = PrefixIndex()
        self._pin_max_share = pin_max_share
        self.default_lease_s = default_lease_s
        self._clock = clock
        self._replicas: dict[LocationId, ReplicaCacheState] = {}
        self.leases = LeaseBook()
        self._tasks: list[asyncio.Task[None]] = []
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
            self._apply(replica, batch)

        async def resync() -> None:
            await self._resync(replica)

        return KVEventSubscriber(events_endpoint, replay_endpoint, apply, resync)

    def detach(self, replica: LocationId) -> None:
        """The replica's engine died: stop listening and forget what it held and pinned.
        Its predictions are not exact until :meth:`reattach` probes the new engine."""
        st = self._replicas[replica]
        st.live, st.agreement = False, "unknown"
        task = self._subscribers.pop(replica, None)
        if task is not None:
            task.cancel()
        st.subscriber.close()
        self.index.apply_cleared(replica)
        self._drop_leases(replica)
        self._drain()

    async def reattach(
        self, replica: LocationId, engine: CoreControlled, probe_tokens: Sequence[int]
    ) -> Agreement:
        """A restarted engine for ``replica``: a fresh subscriber (its event sequence starts
        again), the index rebuilt from the engine, and the hash probe run again."""
        st = self._replicas[replica]
        st.engine = engine
        st.subscriber = self._subscriber(replica, st.events_endpoint, st.replay_endpoint)
        self._subscribers[replica] = asyncio.create_task(st.subscriber.run(), name=f"kv-{replica}")
        await self._resync(replica)
        st.live = True
        return await self.probe(replica, probe_tokens)

    @property
    def replicas(self) -> list[LocationId]:
        return list(self._replicas)

    def _live(self) -> list[ReplicaCacheState]:
        return [st for st in self._replicas.values() if st.live]

    def state(self, replica: LocationId) -> ReplicaCacheState:
        return self._replicas[replica]

    def _drain(self) -> None:
        for ev in self.index.take_events():
            self.index_events[(ev.location, ev.kind)] += ev.blocks

    def _apply(self, replica: LocationId, batch: EventBatch) -> None:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.index.apply_stored(replica, ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                self.index.apply_removed(replica, ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.index.apply_cleared(replica)
                self._drop_leases(replica)
        self._drain()

    async def _resync(self, replica: LocationId) -> None:
        """Rebuild one replica's index from the engine's own view of its cache."""
        resident = await self._replicas[replica].control.resident()
        self.index.apply_cleared(replica)
        self._drop_leases(replica)  # a restarted engine holds no pins: owners must pin again
        self.index.apply_stored(replica, [BlockHash(bytes(h)) for h in resident])
        self._drain()
        log.info("replica %s: index resynced, %d blocks resident", replica, len(resident))

    def _drop_leases(self, replica: LocationId) -> None:
        lost = self.leases.drop(replica)
        if lost:
            log.warning("replica %s: %d pinned blocks lost (cache cleared)", replica, lost)

    async def start(self, probe_tokens: Sequence[int]) -> None:
        """Start the subscribers and the lease reaper, then probe every replica."""
        for st in self._replicas.values():
            task = asyncio.create_task(st.subscriber.run(), name=f"kv-{st.replica}")
            self._subscribers[st.replica] = task
        self._tasks.append(asyncio.create_task(self._reap_forever(), name="pin-reaper"))
        for replica in self._replicas:
            await self.probe(replica, probe_tokens)

    async def close(self) -> None:
        tasks = [*self._tasks, *self._subscribers.values()]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        self._subscribers.clear()
        for st in self._replicas.values():
            if st.live:
                st.subscriber.close()

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
        for st in self._live():
            if barrier:  # an admin operation: a replica that cannot answer is an error
                await self._barrier(st)
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
            await self._barrier(st)
        except EngineError as exc:
            st.synced, st.sync_failures = False, st.sync_failures + 1
            log.warning("replica %s: KV events barrier failed (%s); predictions there are "
                        "not exact until it answers", st.replica, exc)  # fmt: skip
            return
        st.synced = True

    def _all_seen(self, st: ReplicaCacheState) -> bool:
        return all(self.index.match([h])[st.replica] for h in st.answered)

    async def _barrier(self, st: ReplicaCacheState) -> None:
        seq = await st.control.barrier()
        if not await st.subscriber.wait_for(seq):
            log.warning("replica %s: KV events up to %s not seen in time", st.replica, seq)

    # -------------------------------------------------------- prediction

    def hashes(self, prompt: Sequence[int], cache_salt: str | None) -> list[BlockHash]:
        return block_hashes(prompt, self.block_size, self.hash_seed, HashKeys(cache_salt))

    def predict(self, hashes: Sequence[BlockHash], prompt_len: int) -> dict[LocationId, int]:
        """Tokens each replica will serve from cache: whole blocks, never the last token."""
        cap = max(prompt_len - 1, 0) // self.block_size
        matched = self.index.match_digests(hashes[:cap])
        return {r: n * self.block_size for r, n in matched.items()}

    def record_outcome(self, replica: LocationId, predicted: int, actual: int) -> bool:
        st = self._replicas.get(replica)
        matched = predicted == actual
        if st is not None:
            if matched:
                st.predictions_matched += 1
            else:
                st.predictions_missed += 1
                log.info("replica %s: predicted %d cached tokens, vLLM served %d",
                         replica, predicted, actual)  # fmt: skip
        return matched

    def is_exact(self, replica: LocationId) -> bool:
        st = self._replicas.get(replica)
        return st is not None and st.agreement == "exact" and st.synced

    # ------------------------------------------------------------- probe

    async def probe(
        self, replica: LocationId, tokens: Sequence[int], timeout_s: float = 10.0
    ) -> Agreement:
        """Compare the engine's block hashes with ours on a probe prompt."""
        st = self._replicas[replica]
        salt = f"vcache-probe:{replica}"
        expected = self.hashes(tokens, salt)
        await self._prefill(st.engine, tokens, salt, "probe")
        deadline = self._clock() + timeout_s
        want = len(expected)
        while True:
            await self._barrier(st)
            got = self.index.match(expected)[replica]
            if got == want or self._clock() > deadline:
                break
            await asyncio.sleep(0.05)
        st.agreement = "exact" if got == want and want > 0 else "approximate"
        if st.agreement == "approximate":
            log.warning("replica %s: block hashes disagree with the manifest (%d/%d blocks): "
                        "predictions are approximate", replica, got, want)  # fmt: skip
        await st.control.evict(expected)
        return st.agreement

    async def _prefill(
        self, engine: CoreControlled, tokens: Sequence[int], salt: str | None, tag: str
    ) -> int:
        req = GenerateRequest(
            request_id=f"{tag}-{time.monotonic_ns()}",
            prompt_token_ids=tuple(tokens),
            sampling=SamplingOptions(max_tokens=1, temperature=0.0),
            cache_salt=salt,
        )
        cached = 0
        async for chunk in engine.generate(req):
            if chunk.num_cached_tokens is not None:
                cached = chunk.num_cached_tokens
        return cached

    async def warm(
        self, replica: LocationId, tokens: Sequence[int], salt: str | None
    ) -> tuple[int, int]:
        """Prefill ``tokens`` on ``replica`` (one token generated, discarded).

        Returns (tokens that were already cached, tokens now resident).
        """
        st = self._replicas[replica]
        before = await self._prefill(st.engine, tokens, salt, "warm")
        await self._barrier(st)
        now = self.predict(self.hashes(tokens, salt), len(tokens) + 1)[replica]
        return before, now

    # -------------------------------------------------------------- pins

    async def pin(
        self,
        replica: LocationId,
        hashes: Sequence[BlockHash],
        owner: str,
        lease_s: float | None = None,
    ) -> PinResult:
        st = self._replicas[replica]
        lease = Lease(owner, self._clock() + (lease_s or self.default_lease_s))
        fresh = [h for h in hashes if not self.leases.pinned(replica, h)]
        out = PinResult(replica)
        if fresh:
            res = await st.control.pin(fresh, self._pin_max_share)
            took = [BlockHash(h) for h in (*res.pinned, *res.already)]
            out.missing = [h.hex() for h in res.missing]
            out.refused = [h.hex() for h in res.refused]
            self.index.pin(replica, took)
            self._drain()
            self.leases.add(replica, took)
        out.pinned = [h.hex() for h in hashes if self.leases.grant(replica, h, lease)]
        return out

    async def unpin(
        self, replica: LocationId, hashes: Sequence[BlockHash], owner: str | None
    ) -> list[str]:
        """Release ``owner``'s leases (all owners' when None); unpin blocks nobody holds."""
        released = self.leases.release(replica, hashes, owner)
        await self._release(replica, released)
        return [h.hex() for h in released]

    async def _release(self, replica: LocationId, hashes: Sequence[BlockHash]) -> None:
        if not hashes:
            return
        await self._replicas[replica].control.unpin(hashes)
        self.index.unpin(replica, hashes)
        self._drain()

    def pin_owners(self, replica: LocationId, h: BlockHash) -> list[str]:
        return self.leases.owners(replica, h)

    async def reap(self) -> int:
        """Release every lease that has expired; returns how many blocks were unpinned."""
        expired = self.leases.expire(self._clock())
        for replica, hs in expired.items():
            await self._release(replica, hs)
        return sum(len(hs) for hs in expired.values())

    async def _reap_forever(self, every_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.reap()
            except Exception:
                log.exception("pin reaper failed; retrying")

    async def evict(
        self, replica: LocationId, hashes: Sequence[BlockHash]
    ) -> tuple[list[str], list[str]]:
        """Evict blocks no request or pin holds. Returns (evicted, busy) as hex."""
        gone, busy = await self._replicas[replica].control.evict(hashes)
        evicted = [BlockHash(h) for h in gone]
        self.index.apply_removed(replica, evicted)  # the BlockRemoved events agree later
        self._drain()
        return [h.hex() for h in evicted], [h.hex() for h in busy]

    # ------------------------------------------------------------- stats

    async def stats(self) -> dict[str, Any]:
        await self.sync(barrier=True)
        out: dict[str, Any] = {"index_blocks": len(self.index), "replicas": {}}
        for r, st in self._replicas.items():
            counts = self.index.counts(r)
            engine: dict[str, Any] | None = None
            if st.live:
                with contextlib.suppress(EngineError):  # it died between the check and now
                    engine = await st.control.cache_stats()
            sub = st.subscriber.stats
            out["replicas"][r] = {
                "live": st.live and engine is not None,
                "hash_agreement": st.agreement,
                "blocks_resident": counts.resident,
                "blocks_pinned": counts.pinned,
                "blocks_evictable": counts.evictable,
                "engine": engine,
                "predictions": {"matched": st.predictions_matched, "missed": st.predictions_missed},
                "late_event_waits": st.late_event_waits,
                "sync_failures": st.sync_failures,
                "events": {
                    "batches": sub.batches,
                    "gaps": sub.gaps,
                    "replays": sub.replays,
                    "resyncs": sub.resyncs,
                    "last_seq": sub.last_seq,
                },
                "index_events": {k: n for (loc, k), n in self.index_events.items() if loc == r},
            }
        return out
