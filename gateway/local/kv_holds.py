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
the replica's engine sends core calls and requests over one ordered channel
(the embedded engine: one ZMQ socket, a core that applies its inputs in
order), a hold can go ahead of its request instead (:meth:`SpanHolds.ahead`):
sent right before the request, taken before the request is queued, its answer
read before the request's first token.  Its receipt, :class:`PendingHold`,
is given back as a :class:`Hold` is, before or after the answer.
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
from engines.vllm.span_control import HoldReply
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


class PendingHold:
    """A hold to send ahead of its request (:meth:`SpanHolds.ahead`), the receipt from
    then on.  :meth:`send` sends it (right before the request, once); :meth:`result`
    reads the engine's answer, the :class:`HoldResult` :meth:`SpanHolds.take` would
    give; :meth:`give` gives back what it holds, whenever it is called: before it was
    sent, nothing; sent and not answered, its id is released (the engine applies the
    release after the hold: same channel, in order); answered, its :class:`Hold`."""

    def __init__(
        self,
        book: SpanHolds,
        replica: LocationId,
        hold_id: str,
        hashes: Sequence[BlockHash],
        max_share: float,
        reserve: int,
        ttl_s: float,
        on_given: Given | None,
    ) -> None:
        self.replica = replica
        self.hold_id = hold_id
        self._book = book
        self._args = (hashes, max_share, reserve, ttl_s)
        self._on_given = on_given
        self._reply: HoldReply | None = None
        self._result: HoldResult | None = None
        self.given = False

    @property
    def sent(self) -> bool:
        return self._reply is not None

    def send(self) -> None:
        """Send the hold now (idempotent; nothing once given back).  An engine that
        cannot take it leaves the result ``failed``, as :meth:`SpanHolds.take` does."""
        if self._reply is not None or self._result is not None or self.given:
            return
        hashes, max_share, reserve, ttl_s = self._args
        try:
            control = self._book._kv.state(self.replica).control
            self._reply = control.hold_soon(self.hold_id, hashes, max_share, reserve, ttl_s)
        except (EngineError, KeyError) as exc:
            log.debug("replica %s: no hold (%s)", self.replica, exc)
            self._result = HoldResult(None, None, "failed")

    async def result(self) -> HoldResult:
        """The engine's answer (read once): what :meth:`SpanHolds.take` would return.  A
        hold never sent, or given back before its answer was read, holds nothing here."""
        if self._result is not None:
            return self._result
        if self._reply is None:
            return HoldResult(None, None, "failed")
        try:
            n, refused = await self._reply.answer()
        except EngineError as exc:
            log.debug("replica %s: no hold (%s)", self.replica, exc)
            self._result = HoldResult(None, None, "failed")
            return self._result
        if self._result is not None:  # read meanwhile by another caller
            return self._result
        if self.given:  # its id is released already: no receipt to give back
            self._result = HoldResult(None, None if refused else n, refused)
        else:
            self._result = self._book._taken(self.replica, self.hold_id, n, refused, self._on_given)
        return self._result

    def give(self) -> None:
        """Let the blocks go (idempotent), before or after the answer."""
        if self.given:
            return
        self.given = True
        if self._result is not None:
            if self._result.hold is not None:
                self._result.hold.give()
        elif self._reply is not None:
            self._book._unanswered(self.replica, self.hold_id)


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

    def orders(self, replica: LocationId) -> bool:
        """Whether a hold on ``replica`` can go ahead of its request (:meth:`ahead`): its
        engine sends core calls and requests in order on one channel to its core."""
        try:
            return self._kv.state(replica).control.ordered
        except KeyError:
            return False

    def ahead(
        self,
        replica: LocationId,
        hashes: Sequence[BlockHash],
        max_share: float,
        reserve: int,
        ttl_s: float,
        on_given: Given | None = None,
    ) -> PendingHold:
        """A hold as :meth:`take` takes it, to send ahead of its request (only where
        :meth:`orders`): nothing is sent until :meth:`PendingHold.send`."""
        hold_id = f"{self._holder}:{next(self._ids)}"
        return PendingHold(self, replica, hold_id, hashes, max_share, reserve, ttl_s, on_given)

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

    def _unanswered(self, replica: LocationId, hold_id: str) -> None:
        """A hold sent, given back before its answer was read: released in the next
        batch (the engine may hold it; an id it does not hold is nothing to it)."""
        self._pending.setdefault(replica, []).append(hold_id)
        self._wake.set()

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
