"""The governor on the local replicas: pin an anchor's KV blocks while holding them is
worth more than prefilling them again (design note §5.4 on the exact regime).

An anchor here is the run of full blocks a prompt's system prompt (and tools)
renders to, on the replica that served it.  A local cache has no TTL; what
plays its part is how long a block stays resident before the engine evicts it
under pressure.  By Little's law that is the resident blocks over the eviction
rate, both read from the KV events (``T = ∞`` with no evictions: nothing needs
pinning).  Each tick, per anchor, ``manifest.governor.decide`` weighs its
measured gaps against ``T`` (a hit is free, a miss re-prefills the anchor and
costs the latency value on top, a pin costs the pin budget's shadow price):
``heartbeat`` pins the anchor's blocks under a lease renewed every tick;
anything else releases the governor's lease.  The engine's pin budget
(``cache.pin_max_share``) refuses what does not fit; anchors are pinned in
order of reuse.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.core.config import ControlSettings
from gateway.core.loops import every
from gateway.local.spans import KVSpans
from manifest.governor import ArrivalRate, Decision, Economics, TtlOption, Verdict
from manifest.hashing import BlockHash
from manifest.index import LocationId

log = logging.getLogger(__name__)

OWNER = "vcache-governor"
MIN_LEASE_S = 60.0  # a governor pin outlives a few missed ticks


@dataclass
class LocalAnchor:
    replica: LocationId
    hashes: tuple[BlockHash, ...]
    arrivals: ArrivalRate
    verdict: Verdict | None = None
    pinned: bool = False


@dataclass
class _Evictions:
    at: float
    removed: int
    residency_s: float = math.inf


@dataclass
class LocalGovernor:
    cfg: ControlSettings
    kv_of: Callable[[], KVSpans | None]  # the span manager, once the replicas are up
    pin_max_share: float
    clock: Callable[[], float] = time.monotonic
    anchors: dict[tuple[LocationId, BlockHash], LocalAnchor] = field(default_factory=dict)
    evictions: dict[LocationId, _Evictions] = field(default_factory=dict)
    counts: dict[str, int] = field(
        default_factory=lambda: {"pinned": 0, "released": 0, "refused": 0}
    )

    def observe(self, replica: str, hashes: Sequence[BlockHash], blocks: int) -> None:
        """A request whose first ``blocks`` full blocks are its anchor was served there."""
        if blocks <= 0 or len(hashes) < blocks:
            return
        # the chain's last hash names the whole prefix
        key = (LocationId(replica), hashes[blocks - 1])
        a = self.anchors.get(key)
        if a is None:
            if len(self.anchors) >= self.cfg.max_anchors:
                return
            rate = ArrivalRate.empty(self.cfg.horizon_s)
            a = self.anchors[key] = LocalAnchor(key[0], tuple(hashes[:blocks]), rate)
        a.arrivals.add(self.clock())

    def residency_s(self, kv: KVSpans, replica: LocationId, now: float) -> float:
        """Mean residency of a block before eviction: resident / evictions per second
        since the last tick (∞ without evictions)."""
        removed = kv.index_events.get((replica, "removed"), 0)
        last = self.evictions.get(replica)
        self.evictions[replica] = cur = _Evictions(now, removed)
        if last is None:
            return math.inf
        rate = (removed - last.removed) / max(now - last.at, 1e-9)
        resident = kv.index.counts(replica).resident
        cur.residency_s = resident / rate if rate > 0 else math.inf
        return cur.residency_s

    def _pin_pressure(self, kv: KVSpans, replica: LocationId) -> float:
        """μ: the share of the pin budget in use, up to 2 when it is full."""
        c = kv.index.counts(replica)
        budget = self.pin_max_share * max(c.resident, 1)
        return min(2.0, 2.0 * c.pinned / budget)

    def _decide(self, a: LocalAnchor, ttl: float, shadow: float, now: float) -> Verdict:
        """A hit costs nothing, a miss a prefill (and the latency value), a pin ``shadow``."""
        econ = Economics(0.0, (TtlOption(ttl, 1.0),), self.cfg.latency_value)
        return a.arrivals.verdict(econ, shadow, now)

    async def tick(self) -> list[LocalAnchor]:
        """Decide every anchor; pin (or renew) the ones worth holding, release the rest.
        Returns the anchors pinned now."""
        kv = self.kv_of()
        if kv is None:
            return []
        now = self.clock()
        residency = {r: self.residency_s(kv, r, now) for r in kv.replicas}
        lease = max(3 * self.cfg.tick_s, MIN_LEASE_S)
        pinned: list[LocalAnchor] = []
        ranked = sorted(self.anchors.items(), key=lambda kv_: -kv_[1].arrivals.rate(now))
        for key, a in ranked:
            ttl = residency.get(a.replica)
            if ttl is None:  # the replica is gone
                del self.anchors[key]
                continue
            a.verdict = self._decide(a, ttl, self._pin_pressure(kv, a.replica), now)
            if a.verdict.decision is Decision.HEARTBEAT:
                res = await kv.pin(a.replica, a.hashes, OWNER, lease)
                a.pinned = bool(res.pinned)
                self.counts["refused"] += len(res.refused)
                if a.pinned:
                    self.counts["pinned"] += 1
                    pinned.append(a)
            elif a.pinned:
                await kv.unpin(a.replica, a.hashes, OWNER)
                a.pinned = False
                self.counts["released"] += 1
            if a.verdict.decision is Decision.EVICT:
                del self.anchors[key]
        return pinned

    async def run(self) -> None:
        await every(self.cfg.tick_s, self.tick, "local governor tick")
