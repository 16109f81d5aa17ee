"""Holds: the blocks a request was predicted to read, kept in its replica's engine from
routing until the engine has it.

A prediction is made from the blocks a replica holds when the request is routed.
Until vLLM schedules the request (it then references each block it reads),
nothing keeps them: under KV pressure the requests that run meanwhile take the
least recently used free blocks, and the request computes again what it was
predicted to read (predicted warm, served cold).  A hold closes that window:
routing asks the engine core (the plugin's ``vcache_hold``) to take one
reference on the request's leading resident blocks, and the answer, how many
leading blocks it holds, *is* the prediction: the engine's own count at a
moment before the request reaches its queue, which eviction can no longer
change.

A hold is a claim with a receipt (:class:`Hold`): its owner gives it back with
:meth:`Hold.give` at the request's first token (the engine has scheduled it and
its own references keep the blocks), or on any other path (an error, a client
that left, a fallback, a journal that failed).  Giving back is synchronous and
idempotent; the release reaches the engine in one batched call per replica,
sent by :meth:`SpanHolds.run` (started and stopped with the spans).  The engine
bounds every hold (``ttl_s``): one whose owner never gave it back runs out.

Bounded in blocks so it never starves a live request: the engine refuses a
hold (all or nothing) past ``max_share`` of its KV blocks held, or one that
would leave fewer free blocks than the longest request needs (``reserve``).
A refused hold leaves the request's prediction approximate.  (Pinning the
predicted blocks under the pin budget, an earlier design, hung agent turns at a
0.75 budget: a hold kept blocks that the request ahead in vLLM's queue needed.)

The engine core answers a hold between two engine steps, and a request routed
after awaiting it waits for the next step boundary again to be queued.  Where
the replica's engine core takes a hold carried in its request
(:meth:`SpanHolds.in_request`: the embedded engine, engines/vllm/core_holds.py),
the hold can ride in the request instead (``GenerateRequest.hold``): taken as the
core queues the request, let go by the core once it schedules it (or the request
ends before), its answer on the request's first chunk.  No core call, no reply,
no release, and no receipt: the engine core owns it from the send on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from engines.errors import EngineError
from gateway.local.kv_sync import KVSync
from manifest.hashing import BlockHash
from manifest.index import LocationId

log = logging.getLogger(__name__)

Given = Callable[["Hold", float], None]  # a hold given back, after how many seconds


@dataclass(eq=False)
class Hold:
    """One request's hold on its replica: ``blocks`` leading blocks, until given back."""

    replica: LocationId
    hold_id: str
    blocks: int
    taken_at: float
    _give: Callable[[Hold], None] = field(repr=False)
    given: bool = False

    def give(self) -> None:
        """Let the blocks go (idempotent): the engine is told in the next release batch."""
        if not self.given:
            self.given = True
            self._give(self)


class HoldResult(NamedTuple):
    hold: Hold | None  # the receipt (None: nothing held)
    blocks: int | None  # leading blocks resident and held now (None: the engine did not say)
    refused: str  # "" held, or nothing resident; else why not: budget, reserve, failed


class SpanHolds:
    def __init__(self, kv: KVSync, holder: str, clock: Callable[[], float] = time.monotonic):
        self._kv = kv
        # this gateway, as the engines know it, and this book (workers may share an id)
        self._holder = f"{holder}:{secrets.token_hex(4)}"
        self._clock = clock
        self._ids = itertools.count()
        self._pending: dict[LocationId, list[str]] = {}  # given back, not yet released
        self._on_given: dict[str, Given] = {}
        self._wake = asyncio.Event()
        self.held: dict[LocationId, int] = {}  # blocks held per replica, by this gateway

    async def take(
        self,
        replica: LocationId,
        hashes: Sequence[BlockHash],
        max_share: float,
        reserve: int,
        ttl_s: float,
        on_given: Given | None = None,
    ) -> HoldResult:
        """Hold ``hashes``' leading resident blocks on ``replica`` (a prompt's full
        blocks, in order).  A failed engine call is not an error: nothing is held."""
        hold_id = f"{self._holder}:{next(self._ids)}"
        try:
            control = self._kv.state(replica).control
            n, refused = await control.hold(hold_id, hashes, max_share, reserve, ttl_s)
        except EngineError as exc:
            log.debug("replica %s: no hold (%s)", replica, exc)
            return HoldResult(None, None, "failed")
        return self._taken(replica, hold_id, n, refused, on_given)

    def in_request(self, replica: LocationId) -> bool:
        """Whether a hold on ``replica`` can ride in its request: its engine core takes
        ``GenerateRequest.hold`` (engines/vllm/core_holds.py)."""
        try:
            return self._kv.state(replica).control.in_request
        except KeyError:
            return False

    def _taken(
        self, replica: LocationId, hold_id: str, n: int, refused: str, on_given: Given | None
    ) -> HoldResult:
        """The engine's answer to hold ``hold_id``: its receipt, counted, when it holds."""
        if refused:
            return HoldResult(None, None, refused)
        if n == 0:
            return HoldResult(None, 0, "")
        hold = Hold(replica, hold_id, n, self._clock(), self._given)
        self.held[replica] = self.held.get(replica, 0) + n
        if on_given is not None:
            self._on_given[hold_id] = on_given
        return HoldResult(hold, n, "")

    def _given(self, hold: Hold) -> None:
        self.held[hold.replica] -= hold.blocks
        self._pending.setdefault(hold.replica, []).append(hold.hold_id)
        self._wake.set()
        on_given = self._on_given.pop(hold.hold_id, None)
        if on_given is not None:
            on_given(hold, self._clock() - hold.taken_at)

    def pending(self) -> int:
        """Holds given back whose release has not reached their engine yet."""
        return sum(len(v) for v in self._pending.values())

    async def flush(self) -> None:
        """Send the releases given back so far, one call per replica.  A replica that
        cannot be told keeps them until their bound runs out in the engine."""
        pending, self._pending = self._pending, {}
        for replica, ids in pending.items():
            try:
                await self._kv.state(replica).control.release(ids)
            except (EngineError, KeyError) as exc:
                log.debug("replica %s: %d holds not released (%s)", replica, len(ids), exc)

    async def run(self) -> None:
        """Release what is given back, as it is (the spans start and stop it)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.flush()
