"""Agent sessions on the local replicas: the next turn's replica, and the session's KV
kept there across a tool-call pause.

A coding agent's turn ends with a tool call; its next turn, the same prompt
and the tool's result, comes back seconds later.  Meanwhile other traffic may
evict the session's blocks, and the next turn prefills its whole prompt
again.  When a turn of a session ends by calling tools, the prompt's full
blocks are leased on the replica that holds them (a pin with an owner and an
expiry, inside the engine's pin budget) for a high quantile of the gaps this
session has shown (the tenant's before the session has any; a default before
either), times a margin, bounded.  The next turn reads them and its own end
replaces the lease (a rolling lease: blocks the new prompt no longer has are
released); a turn that ends without calling tools (the agent's answer)
releases it; an abandoned session's lease expires on time.

Overtime (``overtime``, on by default): a pause may outlast its estimate (the
gaps' tail), and releasing the blocks then loses them to the next request
that needs room.  So the lease is taken for ``max_lease_s`` and the estimate
is only its *due* time: past it the lease is in overtime, kept while the pin
budget has room, and the first to go when another session's lease is refused
for budget on the same replica (the most overdue first:
``vcache_session_retention_total{outcome="preempted"}``).

:meth:`SessionTurns.replica` is the replica of a session's last turn: the
router sends the next turn back there while that replica is not out of
balance (``vcache_routing_decisions_total{reason="session"}``).  A new
session has none: :meth:`SessionTurns.lease_blocks` (a high quantile of the
leases its tenant's sessions took) lets the router place it where the pin
budget has room for what it will lease (``reason="lease_room"``), not beside
a paused session that leaves it too little.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from gateway.core.config import RetentionSettings
from gateway.core.pieces import Piece
from gateway.local.retention import BreakpointLeases
from gateway.local.spans import KVSpans, PinResult
from manifest.hashing import BlockHash
from manifest.index import LocationId
from manifest.session_tips import Gaps, expected_gap

PauseResult = Literal["leased", "refused", "released", "none", "short", "off"]
# the other counted outcomes: "preempted" (a lease in overtime gave way to another
# session's), "yielded" (a paused session's lease gave way to a live request)
MAX_PREEMPTED = 8  # leases in overtime released for one new lease, at most


@dataclass
class _Session:
    tenant: str
    replica: LocationId | None = None
    ended_at: float | None = None  # None while a turn runs
    gaps: Gaps = field(default_factory=Gaps)
    due: float | None = None  # while its KV is leased: when its pause should have ended


@dataclass
class SessionTurns:
    cfg: RetentionSettings
    leases: BreakpointLeases
    clock: Callable[[], float] = time.monotonic
    sessions: OrderedDict[str, _Session] = field(default_factory=OrderedDict)
    tenants: dict[str, Gaps] = field(default_factory=dict)
    sizes: dict[str, Gaps] = field(default_factory=dict)  # per tenant: blocks of its leases
    count: Callable[[str], None] = lambda outcome: None  # a metric per outcome
    counts: dict[str, int] = field(default_factory=dict)

    def replica(self, key: str | None) -> LocationId | None:
        """The replica that served the session's last turn (None: a new session)."""
        s = self.sessions.get(key) if key is not None else None
        return s.replica if s is not None else None

    def began(self, key: str, tenant: str) -> None:
        """A turn of session ``key`` starts: the gap since its last turn ended is counted."""
        s = self.sessions.pop(key, None) or _Session(tenant)
        self.sessions[key] = s  # the most recent last
        if s.ended_at is not None:
            gap = max(self.clock() - s.ended_at, 0.0)
            s.gaps.add(gap)
            self.tenants.setdefault(tenant, Gaps()).add(gap)
        s.ended_at = None
        while len(self.sessions) > self.cfg.max_sessions:
            self.sessions.popitem(last=False)  # its lease, if any, expires on time

    def lease_s(self, key: str, tenant: str) -> float:
        """How long the session's KV is held after a turn: the quantile of its gaps (the
        tenant's, the default) times the margin, within the bounds."""
        s, c = self.sessions.get(key), self.cfg
        own = s.gaps if s is not None else None
        base = expected_gap(own, self.tenants.get(tenant), c.quantile, c.default_gap_s)
        return min(max(base * c.margin, c.min_lease_s), c.max_lease_s)

    def lease_blocks(self, tenant: str) -> int | None:
        """The blocks a new session of ``tenant`` is expected to lease at its largest: the
        ``quantile`` of its sessions' leases so far (0 before any; None: retention off)."""
        if not self.cfg.enabled:
            return None
        sizes = self.sizes.get(tenant)
        return int(sizes.quantile(self.cfg.quantile) or 0) if sizes is not None else 0

    async def ended(
        self,
        kv: KVSpans | None,
        key: str,
        replica: LocationId,
        hashes: Sequence[BlockHash],
        called_tools: bool,
    ) -> PauseResult:
        """A turn of session ``key`` ended on ``replica`` with a prompt of ``hashes``: lease
        them until the next turn if it called tools, else release the session's lease."""
        s = self.sessions.get(key)
        if s is None:  # forgotten while the turn ran
            s = self.sessions[key] = _Session("")
        now = self.clock()
        s.replica, s.ended_at, s.due = replica, now, None
        owner = _owner(key)
        out: PauseResult
        if kv is None or not self.cfg.enabled:
            out = "off"
        elif not called_tools:  # an answer: the session's lease, if any, is released
            out = "released" if await self.leases.release(kv, owner) else "none"
        elif len(hashes) < self.cfg.min_blocks:
            out = "short"
        else:
            self.sizes.setdefault(s.tenant, Gaps()).add(len(hashes))
            expected = self.lease_s(key, s.tenant)
            ttl = self.cfg.max_lease_s if self.cfg.overtime else expected
            res = await self._hold(kv, replica, key, hashes, ttl)
            out = "leased" if res is not None and not res.refused else "refused"
            s.due = now + expected if res is not None and res.pinned else None
        self._counted(out)
        return out

    async def _hold(
        self,
        kv: KVSpans,
        replica: LocationId,
        key: str,
        hashes: Sequence[BlockHash],
        ttl: float,
    ) -> PinResult | None:
        """Lease ``hashes`` to session ``key``; while the pin budget refuses blocks, release
        the most overdue lease in overtime on ``replica`` and ask again."""
        owner = _owner(key)
        res = await self.leases.hold(kv, replica, owner, hashes, ttl)
        for _ in range(MAX_PREEMPTED):
            if res is None or not res.refused:
                break
            victim = self._overdue(replica, key)
            if victim is None:
                break
            self.sessions[victim].due = None
            await self.leases.release(kv, _owner(victim))
            self._counted("preempted")
            res = await self.leases.hold(kv, replica, owner, hashes, ttl)
        return res

    async def make_room(
        self, kv: KVSpans, replica: LocationId, hashes: Sequence[BlockHash], need: int
    ) -> int:
        """A live request on ``replica`` needs ``need`` KV blocks, its prompt's full blocks
        ``hashes`` among them.  A paused session's lease must never keep it waiting (vLLM
        holds a request it cannot give blocks to, and preempts running ones): while the
        blocks pinned there for others and ``need`` exceed the engine's, paused sessions'
        leases on ``replica`` are released, those in overtime first (the most overdue),
        then those whose pause should end the latest.  Returns how many gave way."""
        book = kv.pins.leases
        if not self.cfg.enabled or not book.count(replica):
            return 0
        total = await kv.num_blocks(replica)
        if total is None:
            return 0

        def short() -> int:
            mine = sum(book.pinned(replica, h) for h in hashes)
            return book.count(replica) - mine + need - total

        released = 0
        for key in self._yield_order(replica) if short() > 0 else ():
            self.sessions[key].due = None
            if await self.leases.release(kv, _owner(key)):
                self._counted("yielded")
                released += 1
            if short() <= 0:
                break
        # still short: the leases of sessions whose next turn is on its way go too (the
        # turn may wait in the engine's queue behind this request, which waits for their
        # blocks: neither would start until the leases ran out)
        mine = set(hashes)
        for key in self._in_flight(replica) if short() > 0 else ():
            held = self.leases.held(_owner(key))
            if held is None or mine.intersection(held[1]):
                continue  # this request's own prefix: it reads those blocks
            if await self.leases.release(kv, _owner(key)):
                self._counted("yielded")
                released += 1
            if short() <= 0:
                break
        return released

    def _in_flight(self, replica: LocationId) -> list[str]:
        """The sessions whose turn runs and whose lease is on ``replica``, the latest
        begun first."""
        return [
            k
            for k, s in reversed(self.sessions.items())
            if s.ended_at is None and self._leased_on(k) == replica
        ]

    def _leased_on(self, key: str) -> LocationId | None:
        held = self.leases.held(_owner(key))
        return held[0] if held is not None else None

    def _yield_order(self, replica: LocationId) -> list[str]:
        """The paused sessions leasing blocks on ``replica``: in overtime first, the most
        overdue first; then the rest, the latest due first."""
        now = self.clock()
        paused = [
            (s.due, k)
            for k, s in self.sessions.items()
            if s.replica == replica
            and s.ended_at is not None
            and s.due is not None
            and now < self._lease_end(s)
        ]
        late = sorted(x for x in paused if x[0] <= now)
        early = sorted((x for x in paused if x[0] > now), reverse=True)
        return [k for _, k in late + early]

    def _lease_end(self, s: _Session) -> float:
        """When a paused session's lease ends: ``max_lease_s`` after its turn in overtime,
        else its due time."""
        assert s.ended_at is not None and s.due is not None
        return s.ended_at + self.cfg.max_lease_s if self.cfg.overtime else s.due

    def _overdue(self, replica: LocationId, but: str) -> str | None:
        """The paused session on ``replica`` whose lease is furthest past its due time
        (None: none is in overtime).  A lease in overtime was taken at the end of its
        session's last turn for ``max_lease_s``."""
        if not self.cfg.overtime:
            return None
        now = self.clock()
        late = [
            (s.due, k)
            for k, s in self.sessions.items()
            if k != but
            and s.replica == replica
            and s.ended_at is not None
            and s.due is not None
            and s.due <= now < self._lease_end(s)
        ]
        return min(late)[1] if late else None

    def _counted(self, outcome: str) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + 1
        self.count(outcome)

    def gap_quantiles(self, tenant: str) -> dict[str, float]:
        """p50 / p90 of the tenant's observed gaps (for stats), empty before any."""
        g = self.tenants.get(tenant)
        if g is None or not len(g):
            return {}
        return {"p50": g.quantile(0.5) or 0.0, "p90": g.quantile(0.9) or 0.0}


def _owner(key: str) -> str:
    """Who holds a session's lease on its blocks."""
    return f"session:{key}"


class Paused:
    """One turn of session ``key``: whether it ended calling tools; at its end (before
    the usage goes out, so a client that comes back at once finds the lease) the
    retention is decided.  A :class:`~gateway.core.pieces.Step`."""

    def __init__(
        self,
        turns: SessionTurns,
        kv: KVSpans | None,
        key: str,
        replica: LocationId,
        hashes: Sequence[BlockHash],
    ) -> None:
        self._turns, self._kv, self._key = turns, kv, key
        self._replica, self._hashes = replica, hashes
        self._called = False

    def step(self, p: Piece) -> Sequence[Piece]:
        if p.index == 0 and p.finish_reason == "tool_calls":
            self._called = True
        return (p,)

    async def end(self, last: Piece) -> Piece:
        await self._turns.ended(self._kv, self._key, self._replica, self._hashes, self._called)
        return last
