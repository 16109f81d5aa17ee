"""A client's cache breakpoints as retention on the local replicas.

Anthropic's ``cache_control`` asks that the prompt through a marked block
stay cached for the marker's TTL.  On the local engine that is a promise the
gateway can keep exactly: the KV blocks through each breakpoint are leased
on the replica that computed them (pins with an owner and an expiry, inside
the engine's pin budget), renewed when the next turn reads them, and
released when the lease ends.  A rolling breakpoint (one that moves to the
last block of every new turn) releases the blocks the previous turn's lease
held and this one does not.

One owner per conversation and TTL tier: the same owner's lease on a block
is replaced, never stacked, so a conversation holds at most one lease per
block and tier.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engines.errors import EngineError
from gateway.local.spans import KVSpans
from manifest.hashing import BlockHash
from manifest.index import LocationId

log = logging.getLogger(__name__)

MAX_OWNERS = 4096  # conversations whose last lease is remembered for the rolling release


@dataclass(frozen=True)
class Held:
    """What a conversation's breakpoint leases hold on one replica."""

    replica: LocationId
    pinned: int  # blocks held now
    refused: int  # over the pin budget: not held
    released: int  # blocks of the previous turn's lease let go


class BreakpointLeases:
    def __init__(self, max_owners: int = MAX_OWNERS) -> None:
        self._last: OrderedDict[str, tuple[LocationId, tuple[BlockHash, ...]]] = OrderedDict()
        self._max = max_owners

    async def hold(
        self,
        kv: KVSpans,
        replica: LocationId,
        owner: str,
        hashes: Sequence[BlockHash],
        ttl_s: float,
    ) -> Held | None:
        """Lease ``hashes`` (a prefix's full blocks) on ``replica`` to ``owner`` for
        ``ttl_s``, then release what the owner's previous lease held that this one does
        not.  None when the engine could not be asked (the request is not failed: its
        blocks are simply not retained)."""
        prev = self._last.pop(owner, None)
        try:
            res = await kv.pin(replica, hashes, owner, ttl_s)
            released = 0
            if prev is not None:
                keep = set(hashes) if prev[0] == replica else set()
                stale = [h for h in prev[1] if h not in keep]
                released = len(await kv.unpin(prev[0], stale, owner)) if stale else 0
        except EngineError as exc:
            log.warning("replica %s: breakpoint lease for %s failed (%s)", replica, owner, exc)
            return None
        self._last[owner] = (replica, tuple(hashes))
        while len(self._last) > self._max:
            self._last.popitem(last=False)  # its lease still expires on time
        return Held(replica, len(res.pinned), len(res.refused), released)
