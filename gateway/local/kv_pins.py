"""Pins on local replicas: blocks held in the engine for owners, each under a lease.

The engine holds one reference per pinned block while any owner's lease on it
is live (the :class:`LeaseBook` says who holds what, until when); pinning past
the engine's pin budget is refused block by block, and a reaper releases
expired leases.  Evicting drops blocks nobody holds, request or pin.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.local.kv_sync import KVSync
from gateway.local.leases import Lease, LeaseBook
from manifest.hashing import BlockHash
from manifest.index import LocationId

log = logging.getLogger(__name__)


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
    ) -> None:
        self._kv = kv
        self.leases = leases
        self._pin_max_share = pin_max_share
        self.default_lease_s = default_lease_s
        self._clock = clock

    async def pin(
        self,
        replica: LocationId,
        hashes: Sequence[BlockHash],
        owner: str,
        lease_s: float | None = None,
    ) -> PinResult:
        lease = Lease(owner, self._clock() + (lease_s or self.default_lease_s))
        fresh = [h for h in hashes if not self.leases.pinned(replica, h)]
        out = PinResult(replica)
        if fresh:
            res = await self._kv.state(replica).control.pin(fresh, self._pin_max_share)
            took = [BlockHash(h) for h in (*res.pinned, *res.already)]
            out.missing = [h.hex() for h in res.missing]
            out.refused = [h.hex() for h in res.refused]
            self._kv.index.pin(replica, took)
            self._kv.drain()
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
        await self._kv.state(replica).control.unpin(hashes)
        self._kv.index.unpin(replica, hashes)
        self._kv.drain()

    def owners(self, replica: LocationId, h: BlockHash) -> list[str]:
        return self.leases.owners(replica, h)

    async def reap(self) -> int:
        """Release every lease that has expired; returns how many blocks were unpinned."""
        expired = self.leases.expire(self._clock())
        for replica, hs in expired.items():
            await self._release(replica, hs)
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
