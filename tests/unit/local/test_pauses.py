"""Agent sessions on the local replicas: a turn that calls tools leases its prompt's
blocks until the next turn, for a quantile of the session's gaps; the next turn's end
rolls the lease; an answer without tool calls releases it; a lease past the pin budget
is refused; an abandoned one expires.  And the router sends a session's next turn back
to its replica."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.core.config import RetentionSettings
from gateway.local.pauses import SessionTurns
from gateway.local.replicas import Replica
from gateway.local.retention import BreakpointLeases
from gateway.local.routing import KvAware, RouteContext
from gateway.local.spans import KVSpans
from manifest.hashing import block_hashes
from manifest.index import LocationId
from manifest.session_tips import Gaps
from tests.unit.local.fake_core import Clock, FakeCore

R = LocationId("replica-0")
HASHES = block_hashes(list(range(128)), 16, "0")  # 8 blocks


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[KVSpans, FakeCore, Clock, SessionTurns]]:
    clock = Clock()
    kv = KVSpans(16, "0", pin_max_share=0.5, default_lease_s=60, clock=clock)
    core = FakeCore(HASHES, capacity=6)
    kv.attach(R, core, f"ipc://{tmp_path}/none", None)
    kv.index.apply_stored(R, HASHES)
    cfg = RetentionSettings(default_gap_s=30, margin=1.5, min_lease_s=5, max_lease_s=120)
    yield kv, core, clock, SessionTurns(cfg, BreakpointLeases(), clock)
    asyncio.run(kv.close())


def _pinned(core: FakeCore) -> int:
    return len(core.pins)


def test_lease_granted_rolled_by_the_next_turn_then_expired(setup: Any) -> None:
    kv, core, clock, turns = setup

    async def main() -> None:
        turns.began("t:s1", "t")
        assert turns.lease_s("t:s1", "t") == 45.0  # no gap seen: the default, times the margin
        assert await turns.ended(kv, "t:s1", R, HASHES[:3], called_tools=True) == "leased"
        assert _pinned(core) == 3 and kv.pin_owners(R, HASHES[0]) == ["session:t:s1"]
        clock.now += 8  # the tool ran for 8 s
        turns.began("t:s1", "t")
        assert turns.lease_s("t:s1", "t") == 12.0  # the session's own gap now
        assert await turns.ended(kv, "t:s1", R, HASHES[:5], called_tools=True) == "leased"
        assert _pinned(core) == 5  # the new prompt's blocks: the old ones kept, two more
        clock.now += 13
        assert await kv.reap() == 0  # past its 12 s: in overtime, the budget has room
        clock.now += 120 - 13
        assert await kv.reap() == 5 and _pinned(core) == 0  # abandoned: max_lease_s, on time

    asyncio.run(main())
    assert turns.counts == {"leased": 2}


def test_without_overtime_a_lease_ends_when_the_pause_was_expected_to(setup: Any) -> None:
    kv, core, clock, _ = setup
    cfg = RetentionSettings(default_gap_s=30, margin=1.5, max_lease_s=120, overtime=False)
    turns = SessionTurns(cfg, BreakpointLeases(), clock)

    async def main() -> None:
        turns.began("t:s1", "t")
        assert await turns.ended(kv, "t:s1", R, HASHES[:3], called_tools=True) == "leased"
        clock.now += 44
        assert await kv.reap() == 0  # within the default 30 s x 1.5
        clock.now += 2
        assert await kv.reap() == 3 and _pinned(core) == 0

    asyncio.run(main())


def test_a_lease_in_overtime_gives_its_blocks_to_a_refused_one(setup: Any) -> None:
    kv, core, clock, turns = setup

    async def main() -> None:
        turns.began("t:a", "t")
        assert await turns.ended(kv, "t:a", R, HASHES[:5], called_tools=True) == "leased"
        clock.now += 1
        turns.began("t:b", "t")  # a is due in 44 s: not in overtime, b gets what is left
        assert await turns.ended(kv, "t:b", R, HASHES[5:8], called_tools=True) == "refused"
        assert kv.pin_owners(R, HASHES[5]) == ["session:t:b"] and _pinned(core) == 6
        turns.began("t:c", "t")
        assert await turns.ended(kv, "t:c", R, HASHES[6:8], called_tools=True) == "refused"
        clock.now += 46  # a and b both past their 45 s: a's lease is the most overdue
        turns.began("t:c", "t")
        assert await turns.ended(kv, "t:c", R, HASHES[6:8], called_tools=True) == "leased"
        assert kv.pin_owners(R, HASHES[0]) == [] and kv.pin_owners(R, HASHES[6]) == ["session:t:c"]
        assert kv.pin_owners(R, HASHES[5]) == ["session:t:b"]  # one preempted lease sufficed
        assert _pinned(core) == 3
        turns.began("t:a", "t")  # a comes back; b is in overtime, c is not
        assert await turns.ended(kv, "t:a", R, HASHES[:5], called_tools=True) == "refused"
        assert kv.pin_owners(R, HASHES[5]) == [] and _pinned(core) == 6  # b's went to a
        assert kv.pin_owners(R, HASHES[6]) == ["session:t:c"]  # c, due later, kept its own

    asyncio.run(main())
    assert turns.counts == {"leased": 2, "refused": 3, "preempted": 2}


def test_an_answer_without_tool_calls_releases_the_lease(setup: Any) -> None:
    kv, core, _, turns = setup

    async def main() -> None:
        turns.began("t:s", "t")
        await turns.ended(kv, "t:s", R, HASHES[:4], called_tools=True)
        assert _pinned(core) == 4
        turns.began("t:s", "t")
        assert await turns.ended(kv, "t:s", R, HASHES[:5], called_tools=False) == "released"
        assert _pinned(core) == 0

    asyncio.run(main())


def test_an_answer_with_no_lease_to_release_is_none(setup: Any) -> None:
    kv, _, _, turns = setup

    async def main() -> None:
        turns.began("t:q", "t")
        assert await turns.ended(kv, "t:q", R, HASHES[:4], called_tools=False) == "none"

    asyncio.run(main())


def test_past_the_pin_budget_the_lease_is_refused(setup: Any) -> None:
    kv, core, _, turns = setup

    async def main() -> None:
        turns.began("t:a", "t")
        assert await turns.ended(kv, "t:a", R, HASHES[:6], called_tools=True) == "leased"
        turns.began("t:b", "t")
        assert await turns.ended(kv, "t:b", R, HASHES[6:8], called_tools=True) == "refused"
        assert _pinned(core) == 6  # the budget, held by the first session

    asyncio.run(main())


def test_a_short_prompt_is_not_worth_a_lease(setup: Any) -> None:
    kv, core, _, turns = setup

    async def main() -> None:
        turns.began("t:s", "t")
        assert await turns.ended(kv, "t:s", R, HASHES[:1], called_tools=True) == "short"
        assert _pinned(core) == 0

    asyncio.run(main())


def test_a_new_session_leases_for_its_tenants_gaps(setup: Any) -> None:
    kv, _, clock, turns = setup

    async def main() -> None:
        for gap in (4.0, 6.0, 40.0):
            turns.began("t:old", "t")
            await turns.ended(kv, "t:old", R, HASHES[:2], called_tools=True)
            clock.now += gap
        turns.began("t:old", "t")
        assert turns.lease_s("t:new", "t") == 60.0  # the tenant's p90 (40 s) x 1.5
        assert turns.lease_s("u:new", "u") == 45.0  # another tenant: the default
        assert turns.gap_quantiles("t") == {"p50": 6.0, "p90": 40.0}

    asyncio.run(main())


def test_gap_quantiles() -> None:
    g = Gaps()
    assert g.quantile(0.9) is None
    for x in range(1, 11):
        g.add(float(x))
    assert (g.quantile(0.5), g.quantile(0.9), g.quantile(0.99)) == (5.0, 9.0, 10.0)


class _Engine:
    ready = True


def _replica(name: str, inflight: int = 0) -> Replica:
    r = Replica(LocationId(name), _Engine(), None, None)  # type: ignore[arg-type]
    r.inflight = inflight
    return r


def test_a_session_goes_back_to_its_replica_while_it_holds_as_much() -> None:
    a, b = _replica("replica-0"), _replica("replica-1")
    kv = KvAware(imbalance=2)
    same = {a.id: 256, b.id: 256}
    assert kv.choose([a, b], RouteContext(same, session=b.id)).reason == "session"
    assert kv.choose([a, b], RouteContext(same, session=b.id)).replica is b
    cold = {a.id: 0, b.id: 0}
    assert kv.choose([a, b], RouteContext(cold, session=b.id)).replica is b
    assert kv.choose([a, b], RouteContext(None, session=b.id)).replica is b  # no index
    longer = {a.id: 512, b.id: 256}  # its spans were evicted there: the prefix decides
    assert kv.choose([a, b], RouteContext(longer, session=b.id)).reason == "longest_prefix"
    busy = _replica("replica-1", inflight=5)  # out of balance: the load guard stays
    d = kv.choose([a, busy], RouteContext(same, session=busy.id))
    assert d.replica is a and d.reason != "session"
