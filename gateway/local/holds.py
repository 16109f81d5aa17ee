"""Predicted blocks held on their replica from routing to the request's first token.

Routing predicts a request's cached tokens from the blocks its replica holds
now.  Until vLLM schedules the request (it then references each block it
reads), nothing keeps those blocks: requests running there meanwhile allocate
from the least recently used end of the engine's free queue, and under KV
pressure a prefix last read seconds ago goes first.  The longer the wait (the
first-token guard, a fair slot, a stopped prefill, vLLM's own queue), the
likelier; the request then computes again what it was predicted to read.

A hold pins the predicted blocks under a lease of the request's own (owner
``hold:<request id>``), for at most ``hold_s``, and lets them go at the first
token, when the running request references them, or at its end.  Blocks a
session's lease already holds cost no engine call.  The pin is sent before the
request (the embedded engine core reads both from one input queue, in order)
and nothing waits for its answer, so a hold never delays a request by a step.
Pins count against ``cache.pin_max_share``: past it a hold is refused block by
block, and the request runs as it would have without.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engines.errors import EngineError
from gateway.local.kv_pins import PinResult
from gateway.local.spans import KVSpans
from manifest.hashing import BlockHash
from manifest.index import LocationId

log = logging.getLogger(__name__)

Count = Callable[[LocationId, str, int], None]  # (replica, result, blocks)


@dataclass(eq=False)
class Hold:
    replica: LocationId
    hashes: tuple[BlockHash, ...]
    owner: str
    pinning: asyncio.Task[PinResult] = field(repr=False)


class Holds:
    def __init__(self, kv: KVSpans, hold_s: float, count: Count | None = None) -> None:
        self._kv = kv
        self._hold_s = hold_s
        self._count = count or (lambda replica, result, n: None)
        self._background: set[asyncio.Task[None]] = set()

    def take(
        self, replica: LocationId, hashes: Sequence[BlockHash], tokens: int, request_id: str
    ) -> Hold | None:
        """Hold the blocks of the ``tokens`` predicted cached (None: nothing to hold).
        The pin is under way when this returns; call :meth:`release` in every case."""
        n = tokens // self._kv.block_size
        if n <= 0:
            return None
        owner = f"hold:{request_id}"
        held = tuple(hashes[:n])
        task = asyncio.create_task(self._pin(replica, held, owner), name=owner)
        return Hold(replica, held, owner, task)

    async def _pin(
        self, replica: LocationId, hashes: tuple[BlockHash, ...], owner: str
    ) -> PinResult:
        res = await self._kv.pin(replica, hashes, owner, self._hold_s)
        for result, blocks in (("held", res.pinned), ("refused", res.refused),
                               ("missing", res.missing)):  # fmt: skip
            if blocks:
                self._count(replica, result, len(blocks))
        return res

    def release(self, hold: Hold | None) -> None:
        """Let ``hold``'s blocks go, in the background (after its pin, if that is still
        on its way): nothing that streams waits for it."""
        if hold is None:
            return
        task = asyncio.create_task(self._release(hold), name=f"release {hold.owner}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, hold: Hold) -> None:
        try:
            await hold.pinning
        except EngineError as exc:  # no pin, nothing to let go
            log.debug("%s: not held (%s)", hold.owner, exc)
            return
        try:
            await self._kv.unpin(hold.replica, hold.hashes, hold.owner)
        except EngineError as exc:  # the lease runs out; the reaper tries again then
            log.debug("%s: not released (%s)", hold.owner, exc)

    async def close(self) -> None:
        """Wait for the releases still under way (at shutdown)."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
