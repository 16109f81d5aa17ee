"""The governor on local replicas: pins what eviction pressure would cost a re-prefill,
releases it when the pressure is gone (a fake span manager; the engine's pin budget is
tested with the real engine in tests/integration)."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.core.config import ControlSettings
from gateway.local.governor import OWNER, LocalGovernor
from gateway.local.spans import PinResult
from manifest.governor import Decision
from manifest.hashing import BlockHash
from manifest.index import LocationId, PrefixIndex

R = LocationId("replica-0")
ANCHOR = [BlockHash(bytes([i]) * 32) for i in range(4)]
OTHER = [BlockHash(bytes([100 + i]) * 32) for i in range(4)]


@dataclass
class FakeSpans:
    index: PrefixIndex = field(default_factory=PrefixIndex)
    index_events: Counter[tuple[LocationId, str]] = field(default_factory=Counter)
    calls: list[tuple[str, int, str | None]] = field(default_factory=list)

    @property
    def replicas(self) -> list[LocationId]:
        return [R]

    async def pin(
        self, replica: LocationId, hashes: Sequence[BlockHash], owner: str, lease: float
    ) -> PinResult:
        self.calls.append(("pin", len(hashes), owner))
        self.index.pin(replica, hashes)
        return PinResult(replica, pinned=[h.hex() for h in hashes])

    async def unpin(
        self, replica: LocationId, hashes: Sequence[BlockHash], owner: str | None
    ) -> list[str]:
        self.calls.append(("unpin", len(hashes), owner))
        self.index.unpin(replica, hashes)
        return [h.hex() for h in hashes]


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _governor() -> tuple[LocalGovernor, FakeSpans, Clock]:
    spans, clock = FakeSpans(), Clock()
    filler = [BlockHash(i.to_bytes(32, "big")) for i in range(1000, 1492)]
    spans.index.apply_stored(R, [*ANCHOR, *OTHER, *filler])
    kv: Any = spans
    cfg = ControlSettings(mode="govern", tick_s=10)
    return LocalGovernor(cfg, lambda: kv, 0.5, clock), spans, clock


def test_an_anchor_evicted_between_its_arrivals_is_pinned_and_released_without_pressure() -> None:
    gov, spans, clock = _governor()
    assert asyncio.run(gov.tick()) == []  # first tick: no eviction rate measured yet
    for t in (0.0, 60.0, 120.0, 180.0):  # the anchor comes back every minute
        clock.now = t
        gov.observe(R, [*ANCHOR, BlockHash(b"x" * 32)], 4)
    gov.observe(R, OTHER, 4)  # seen once
    clock.now = 190.0
    spans.index_events[(R, "removed")] += 1900  # 10 evictions/s over 500 resident: T = 50 s
    pinned = asyncio.run(gov.tick())
    assert [a.hashes for a in pinned] == [tuple(ANCHOR)]
    assert gov.evictions[R].residency_s == 50.0
    assert spans.calls == [("pin", 4, OWNER)]
    assert spans.index.counts(R).pinned == 4
    others = [a for a in gov.anchors.values() if a.hashes == tuple(OTHER)]
    assert others[0].verdict is not None and others[0].verdict.decision is Decision.LAZY

    clock.now = 200.0  # no more evictions: residency is unbounded, nothing needs a pin
    asyncio.run(gov.tick())
    assert gov.evictions[R].residency_s == math.inf
    assert spans.calls[-1] == ("unpin", 4, OWNER) and spans.index.counts(R).pinned == 0
    assert gov.counts == {"pinned": 1, "released": 1, "refused": 0}


def test_anchors_idle_past_the_horizon_are_forgotten() -> None:
    gov, _, clock = _governor()
    gov.observe(R, ANCHOR, 4)
    gov.observe(R, ANCHOR, 2)  # a shorter anchor is another prefix
    assert len(gov.anchors) == 2
    gov.observe(R, ANCHOR, 0)  # no full block of system prompt: no anchor
    clock.now = 4000.0
    asyncio.run(gov.tick())
    assert gov.anchors == {}
