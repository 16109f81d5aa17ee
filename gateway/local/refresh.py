"""A request's predicted cached blocks made the last its replica evicts, from routing on.

Routing predicts a request's cached tokens from the blocks its replica holds
now.  Until vLLM schedules the request (it then references each block it
reads), nothing keeps those blocks: requests running there meanwhile take
blocks from the least recently used end of the engine's free queue, and under
KV pressure a prefix last read seconds ago goes first.  The longer the wait
(the first-token guard, a fair slot, a stopped prefill, vLLM's own queue), the
likelier; the request then computes again what it was predicted to read.

So the dispatcher *touches* them (the engine plugin's ``vcache_touch``): each
resident block no request or pin holds moves to the most recently used end of
the free queue, the prompt's first block last, as if the request had just read
it.  Every other free block is evicted before them.  Nothing is pinned: a
request that needs the room still gets it, so a touch can never keep the
engine from scheduling (a pin held for a waiting request could, with the
request ahead of it waiting for those blocks).  The touch goes out before the
request (the embedded engine core reads both from one input queue, in order),
again when the request leaves a wait in the gateway, and nothing waits for its
answer: it never delays a request by a step.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from engines.errors import EngineError
from gateway.local.spans import KVSpans
from manifest.hashing import BlockHash
from manifest.index import LocationId

log = logging.getLogger(__name__)

Count = Callable[[LocationId, str, int], None]  # (replica, result, blocks)


class Refresh:
    def __init__(self, kv: KVSpans, count: Count | None = None) -> None:
        self._kv = kv
        self._count = count or (lambda replica, result, n: None)
        self._under_way: set[asyncio.Task[None]] = set()

    def touch(self, replica: LocationId, hashes: Sequence[BlockHash], tokens: int) -> bool:
        """Touch the blocks of the ``tokens`` predicted cached, in the background; False
        when there are none.  The call is sent once the caller next yields."""
        n = tokens // self._kv.block_size
        if n <= 0:
            return False
        task = asyncio.create_task(self._touch(replica, tuple(hashes[:n])))
        self._under_way.add(task)
        task.add_done_callback(self._under_way.discard)
        return True

    async def _touch(self, replica: LocationId, hashes: tuple[BlockHash, ...]) -> None:
        try:
            touched, missing = await self._kv.touch(replica, hashes)
        except EngineError as exc:  # a replica restarting: its request fails on its own
            log.debug("replica %s: no touch (%s)", replica, exc)
            return
        self._count(replica, "touched", touched)
        if missing:  # evicted between the index's last event and the touch
            self._count(replica, "missing", len(missing))

    async def settle(self) -> None:
        """Wait for the touches under way (at shutdown)."""
        if self._under_way:
            await asyncio.gather(*self._under_way, return_exceptions=True)
