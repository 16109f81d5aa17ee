"""Exact KV spans on local vLLM replicas: the manifest's page table over each engine.

:class:`KVSpans` is what the rest of the gateway holds; it is made of

- :class:`~gateway.local.kv_sync.KVSync`: each replica's KV events folded into
  one :class:`PrefixIndex` (location = replica id), gaps repaired, barriers;
- :class:`~gateway.local.kv_pins.SpanPins`: pins with owners and leases
  (a pure :class:`LeaseBook`, the clock injected) and eviction;
- :class:`~gateway.local.kv_holds.SpanHolds`: a routed request's predicted blocks
  held in its engine until it is scheduled (receipts given back on every path);
- :mod:`~gateway.local.kv_probe`: the hash probe run at start (a client's warm is a request
  through the service loop).

and itself predicts, before dispatch, how many prompt tokens each replica
will serve from cache, and counts whether vLLM's ``num_cached_tokens`` agreed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from engines.base import GenerateRequest
from engines.errors import EngineError
from engines.lora import LoraRef
from gateway.local import kv_probe
from gateway.local.kv_holds import SpanHolds
from gateway.local.kv_pins import PinResult, SpanPins
from gateway.local.kv_sync import Agreement, CoreControlled, KVSync, ReplicaCacheState
from gateway.local.leases import LeaseBook
from manifest.hashing import BlockHash, HashKeys, HashMemo, MMSpan, block_hashes
from manifest.index import LocationId, PrefixIndex

log = logging.getLogger(__name__)
NUM_BLOCKS_RETRY_S = 30.0  # an engine that could not say how many KV blocks it has

__all__ = ["Agreement", "CoreControlled", "KVSpans", "PinResult", "ReplicaCacheState"]


class KVSpans:
    def __init__(
        self,
        block_size: int,
        hash_seed: str,
        pin_max_share: float,
        default_lease_s: float,
        clock: Callable[[], float] = time.monotonic,
        holder: str = "",
    ) -> None:
        self.block_size = block_size
        self.hash_seed = hash_seed
        self.index = PrefixIndex()
        self.leases = LeaseBook()
        self.events = KVSync(self.index, self.leases)
        self.pins = SpanPins(
            self.events, self.leases, pin_max_share, default_lease_s, clock, holder
        )
        self.holds = SpanHolds(self.events, holder or "gateway", clock)
        self._clock = clock
        self._memo = HashMemo()  # the blocks prompts share (a system prompt's), hashed once
        self._reaper: asyncio.Task[None] | None = None
        self._releaser: asyncio.Task[None] | None = None

    # ---------------------------------------------------------- replicas

    def attach(
        self,
        replica: LocationId,
        engine: CoreControlled,
        events_endpoint: str,
        replay_endpoint: str | None,
    ) -> None:
        self.events.attach(replica, engine, events_endpoint, replay_endpoint)

    def detach(self, replica: LocationId) -> None:
        """The replica's engine died: stop listening and forget what it held and pinned.
        Its predictions are not exact until :meth:`reattach` probes the new engine."""
        self.events.detach(replica)

    async def reattach(
        self, replica: LocationId, engine: CoreControlled, probe_tokens: Sequence[int]
    ) -> Agreement:
        """A restarted engine for ``replica``: listened to, resynced and probed again."""
        await self.events.reattach(replica, engine)
        return await self.probe(replica, probe_tokens)

    async def start(self, probe_tokens: Sequence[int]) -> None:
        """Start the subscribers and the lease reaper, then probe every replica."""
        self.events.start()
        self._reaper = asyncio.create_task(self.pins.reap_forever(), name="pin-reaper")
        self._releaser = asyncio.create_task(self.holds.run(), name="hold-releaser")
        for replica in self.events.replicas:
            await self.probe(replica, probe_tokens)

    async def close(self) -> None:
        for task in (self._reaper, self._releaser):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._reaper = self._releaser = None
        await self.holds.flush()  # the holds given back before the close
        await self.events.close()

    @property
    def replicas(self) -> list[LocationId]:
        return self.events.replicas

    @property
    def default_lease_s(self) -> float:
        return self.pins.default_lease_s

    @property
    def index_events(self) -> Counter[tuple[LocationId, str]]:
        return self.events.index_events

    def state(self, replica: LocationId) -> ReplicaCacheState:
        return self.events.state(replica)

    def answered(self, replica: LocationId, hashes: Sequence[BlockHash]) -> None:
        self.events.answered(replica, hashes)

    async def sync(self, barrier: bool = False) -> None:
        await self.events.sync(barrier)

    # -------------------------------------------------------- prediction

    def hashes(
        self,
        prompt: Sequence[int],
        cache_salt: str | None,
        lora: LoraRef | None = None,
        mm: Sequence[MMSpan] = (),
    ) -> list[BlockHash]:
        """``prompt``'s full blocks as vLLM hashes them: under an adapter every block is
        keyed by ``("lora", name, path)`` (so the same prompt under two adapters, or
        under none, shares no block), the first by the cache salt; each block an image's
        placeholders overlap by ``("mm", identifier, offset)`` (``mm``: the images' spans,
        :func:`image_spans`)."""
        keys = HashKeys(
            cache_salt=cache_salt,
            lora_name=lora.name if lora is not None else None,
            lora_path=lora.path if lora is not None else None,
            mm=tuple(sorted(mm, key=lambda s: s.offset)),
        )
        return block_hashes(prompt, self.block_size, self.hash_seed, keys, self._memo)

    def predict(self, hashes: Sequence[BlockHash], prompt_len: int) -> dict[LocationId, int]:
        """Tokens each replica will serve from cache: whole blocks, never the last token."""
        cap = max(prompt_len - 1, 0) // self.block_size
        matched = self.index.match_digests(hashes[:cap])
        return {r: n * self.block_size for r, n in matched.items()}

    def record_outcome(self, replica: LocationId, predicted: int, actual: int) -> bool:
        matched = predicted == actual
        if replica in self.events.replicas:
            st = self.events.state(replica)
            if matched:
                st.predictions_matched += 1
            else:
                st.predictions_missed += 1
                log.info(
                    "replica %s: predicted %d cached tokens, vLLM served %d",
                    replica,
                    predicted,
                    actual,
                )
        return matched

    def is_exact(self, replica: LocationId) -> bool:
        if replica not in self.events.replicas:
            return False
        st = self.events.state(replica)
        return st.agreement == "exact" and st.synced

    # ------------------------------------------------------ probe, warm

    async def probe(self, replica: LocationId, tokens: Sequence[int]) -> Agreement:
        """Compare the engine's block hashes with ours on a probe prompt.

        The salt is this probe's own: gateway workers sharing one engine core probe it
        at the same time, and a probe whose prompt hit another's blocks (then evicted by
        that probe) would see no blocks of its own stored."""
        salt = f"vcache-probe:{replica}:{secrets.token_hex(8)}"
        expected = self.hashes(tokens, salt)
        return await kv_probe.probe(self.events, replica, tokens, expected, salt, self._clock)

    async def num_blocks(self, replica: LocationId) -> int | None:
        """The engine's KV blocks on ``replica`` (asked once; None when it cannot be)."""
        st = self.events.state(replica)
        if st.num_blocks is None and self._clock() >= st.num_blocks_retry_at:
            try:
                st.num_blocks = int((await st.control.cache_stats())["num_blocks"])
            except (EngineError, KeyError, TypeError, ValueError) as exc:
                log.debug("replica %s: no block count (%s)", replica, exc)
                st.num_blocks_retry_at = self._clock() + NUM_BLOCKS_RETRY_S
        return st.num_blocks

    async def pin_room(self, replica: LocationId) -> int | None:
        """Blocks the pin budget on ``replica`` has left for this gateway's leases (None:
        its block count is not known).  Another gateway's pins there are not counted: the
        engine refuses what does not fit."""
        total = await self.num_blocks(replica)
        if total is None:
            return None
        return int(total * self.pins.pin_max_share) - self.leases.count(replica)

    # -------------------------------------------------------------- pins

    async def pin(
        self,
        replica: LocationId,
        hashes: Sequence[BlockHash],
        owner: str,
        lease_s: float | None = None,
    ) -> PinResult:
        return await self.pins.pin(replica, hashes, owner, lease_s)

    async def unpin(
        self, replica: LocationId, hashes: Sequence[BlockHash], owner: str | None
    ) -> list[str]:
        return await self.pins.unpin(replica, hashes, owner)

    def pin_owners(self, replica: LocationId, h: BlockHash) -> list[str]:
        return self.pins.owners(replica, h)

    async def reap(self) -> int:
        return await self.pins.reap()

    async def evict(
        self, replica: LocationId, hashes: Sequence[BlockHash]
    ) -> tuple[list[str], list[str]]:
        return await self.pins.evict(replica, hashes)

    async def touch(
        self, replica: LocationId, hashes: Sequence[BlockHash]
    ) -> tuple[int, list[BlockHash]]:
        """Make ``hashes``' resident blocks the last ``replica`` evicts (``refresh.py``):
        (how many were touched, those not resident)."""
        touched, missing = await self.state(replica).control.touch(hashes)
        return touched, [BlockHash(h) for h in missing]

    # ------------------------------------------------------------- stats

    async def stats(self) -> dict[str, Any]:
        await self.sync(barrier=True)
        out: dict[str, Any] = {"index_blocks": len(self.index), "replicas": {}}
        for st in self.events.states():
            out["replicas"][st.replica] = await self._replica_stats(st)
        return out

    async def _replica_stats(self, st: ReplicaCacheState) -> dict[str, Any]:
        r = st.replica
        counts = self.index.counts(r)
        engine: dict[str, Any] | None = None
        if st.live:
            with contextlib.suppress(EngineError):  # it died between the check and now
                engine = await st.control.cache_stats()
        sub = st.subscriber.stats
        return {
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


def image_spans(greq: GenerateRequest) -> tuple[MMSpan, ...]:
    """The spans of ``greq``'s images in its (expanded) prompt, for its block keys."""
    return tuple(MMSpan(i.identifier, i.offset, i.length) for i in greq.images)
