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

from engines.errors import EngineError
from gateway.local.spans import KVSpans, PinResult
from manifest.hashing import BlockHash
from manifest.index import LocationId

log = logging.getLogger(__name__)

MAX_OWNERS = 4096  # conversations whose last lease is remembered for the rolling release


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
    ) -> PinResult | None:
        """Lease ``hashes`` (a prefix's full blocks) on ``replica`` to ``owner`` for
        ``ttl_s``, then release what the owner's previous lease held that this one does
        not.  An engine that cannot be asked fails nothing: the blocks are simply not
        retained.  Blocks over the pin budget are not held (the engine refuses them).
        Returns what the engine pinned, or None when it could not be asked."""
        prev = self._last.pop(owner, None)
        try:
            res = await kv.pin(replica, hashes, owner, ttl_s)
            if prev is not None:
                keep = set(hashes) if prev[0] == replica else set()
                stale = [h for h in prev[1] if h not in keep]
                if stale:
                    await kv.unpin(prev[0], stale, owner)
        except EngineError as exc:
            log.warning("replica %s: breakpoint lease for %s failed (%s)", replica, owner, exc)
            return None
        self._last[owner] = (replica, tuple(hashes))
        while len(self._last) > self._max:
            self._last.popitem(last=False)  # its lease still expires on time
        return res

    def held(self, owner: str) -> tuple[LocationId, tuple[BlockHash, ...]] | None:
        """The replica and blocks of ``owner``'s last lease (None: it holds none)."""
        return self._last.get(owner)

    async def release(self, kv: KVSpans, owner: str) -> int:
        """Release what ``owner``'s last lease holds; how many blocks it held."""
        prev = self._last.pop(owner, None)
        if prev is None:
            return 0
        try:
            await kv.unpin(prev[0], prev[1], owner)
        except EngineError as exc:  # the lease still expires on time
            log.warning("replica %s: releasing %s failed (%s)", prev[0], owner, exc)
        return len(prev[1])
