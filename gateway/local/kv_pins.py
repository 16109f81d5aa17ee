"""Pins on local replicas: blocks held in the engine for owners, each under a lease.

The engine holds one reference per pinned block while any owner's lease on it
is live (the :class:`LeaseBook` says who holds what, until when); pinning past
the engine's pin budget is refused block by block, and a reaper releases
expired leases.  Evicting drops blocks nobody holds, request or pin.

Several gateways may pin on one replica (active-active): the engine records
each gateway's *hold* on a block (its ``holder`` id) for the gateway's longest
lease plus :data:`HOLD_SLACK_S`, renewed when a lease outgrows it.  A gateway
releases only its own hold, so it never unpins another's blocks, and one that
dies leaks nothing: its holds run out, and every gateway's reaper asks each
replica to sweep them every :data:`SWEEP_EVERY_S`.

Pinning and releasing on one replica take turns (a lock per replica): each
decides from the book, asks the engine, and writes the book back before the
next decides.  Otherwise a release could free a block in the book while a pin
of it is on its way to the engine, and the engine would drop a pin the book
still holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engines.errors import EngineError
from gateway.local.kv_sync import KVSync
from gateway.local.leases import Lease, LeaseBook
from manifest.hashing import BlockHash
from manifest.index import LocationId

log = logging.getLogger(__name__)
HOLD_SLACK_S = 10.0  # an engine hold outlives its lease by this (the owner releases first)
SWEEP_EVERY_S = 5.0


@dataclass
class PinResult:
    replica: LocationId
    pinned: list[str] = field(default_factory=list)  # hex hashes held for this owner now
    missing: list[str] = field(default_factory=list)  # not resident: nothing to pin
    refused: list[str] = field(default_factory=list)  # over the pin budget


class SpanPins:
    def __init__(
        self,
        kv: KVSync,
        leases: LeaseBook,
        pin_max_share: float,
        default_lease_s: float,
        clock: Callable[[], float] = time.monotonic,
        holder: str = "",
    ) -> None:
        self._kv = kv
        self.leases = leases
        self.pin_max_share = pin_max_share
        self.default_lease_s = default_lease_s
        self._clock = clock
        self.holder = holder  # this gateway, as the engines know it
        self._hold_until: dict[tuple[LocationId, BlockHash], float] = {}
        self._swept_at = clock()
        self._turns: dict[LocationId, asyncio.Lock] = {}

    def _turn(self, replica: LocationId) -> asyncio.Lock:
        """The replica's lock: one book-and-engine change at a time."""
        return self._turns.setdefault(replica, asyncio.Lock())

    async def pin(
        self,
        replica: LocationId,
        hashes: Sequence[BlockHash],
        owner: str,
        lease_s: float | None = None,
    ) -> PinResult:
        async with self._turn(replica):
            return await self._pin(replica, hashes, owner, lease_s)

    async def _pin(
        self, replica: LocationId, hashes: Sequence[BlockHash], owner: str, lease_s: float | None
    ) -> PinResult:
        now = self._clock()
        lease = Lease(owner, now + (lease_s or self.default_lease_s))
        # new blocks, and held ones whose engine hold would end before this lease
        need = [
            h
            for h in hashes
            if not self.leases.pinned(replica, h)
            or self._hold_until.get((replica, h), 0.0) < lease.expires_at
        ]
        out = PinResult(replica)
        if need:
            hold_s = lease.expires_at - now + HOLD_SLACK_S
            control = self._kv.state(replica).control
            res = await control.pin(need, self.pin_max_share, self.holder, hold_s)
            took = [BlockHash(h) for h in (*res.pinned, *res.already)]
            out.missing = [h.hex() for h in res.missing]
            out.refused = [h.hex() for h in res.refused]
            # the index holds one pin per block this gateway holds: a renewed hold is not
            # another (its release unpins once)
            self._kv.index.pin(replica, [h for h in took if not self.leases.pinned(replica, h)])
            self._kv.drain()
            self.leases.add(replica, took)
            for h in took:
                self._hold_until[(replica, h)] = now + hold_s
        out.pinned = [h.hex() for h in hashes if self.leases.grant(replica, h, lease)]
        return out

    async def unpin(
        self, replica: LocationId, hashes: Sequence[BlockHash], owner: str | None
    ) -> list[str]:
        """Release ``owner``'s leases (all owners' when None); unpin blocks nobody holds."""
        async with self._turn(replica):
            released = self.leases.release(replica, hashes, owner)
            await self._release(replica, released)
        return [h.hex() for h in released]

    async def _release(self, replica: LocationId, hashes: Sequence[BlockHash]) -> None:
        if not hashes:
            return
        for h in hashes:
            self._hold_until.pop((replica, h), None)
        # blocks another gateway holds stay pinned in the engine; this gateway's index
        # counts only its own pins (it would not learn when the other lets go)
        await self._kv.state(replica).control.unpin(hashes, self.holder)
        self._kv.index.unpin(replica, hashes)
        self._kv.drain()

    def owners(self, replica: LocationId, h: BlockHash) -> list[str]:
        return self.leases.owners(replica, h)

    async def reap(self) -> int:
        """Release every lease that has expired; returns how many blocks were unpinned."""
        now = self._clock()
        expired: dict[LocationId, list[BlockHash]] = {}
        for replica in self.leases.replicas():
            async with self._turn(replica):
                expired[replica] = self.leases.expire(now, replica).get(replica, [])
                await self._release(replica, expired[replica])
        if now - self._swept_at >= SWEEP_EVERY_S:  # holds of gateways that died
            self._swept_at = now
            for replica in self._kv.replicas:
                try:
                    gone = await self._kv.state(replica).control.sweep()
                except EngineError as exc:  # a replica down: swept when it is back
                    log.debug("replica %s: no sweep (%s)", replica, exc)
                    continue
                if gone:
                    log.info("replica %s: %d pinned blocks whose holds ran out", replica, len(gone))
                    self._kv.index.unpin(replica, [BlockHash(h) for h in gone])
                    self._kv.drain()
        return sum(len(hs) for hs in expired.values())

    async def reap_forever(self, every_s: float = 1.0) -> None:
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
        gone, busy = await self._kv.state(replica).control.evict(hashes)
        evicted = [BlockHash(h) for h in gone]
        self._kv.index.apply_removed(replica, evicted)  # the BlockRemoved events agree later
        self._kv.drain()
        return [h.hex() for h in evicted], [h.hex() for h in busy]
