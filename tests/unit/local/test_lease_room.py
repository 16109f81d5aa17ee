"""A new agent session goes where the pin budget has room for what it will lease.

Two live sessions on one replica share its pin budget: the second's lease is refused
in part, and what is refused is prefilled again after each tool-call pause.  A new
session's first turn (no replica of its own yet) is placed by the longest cached
prefix unless another replica's budget keeps more of the session's expected lease
(its tenant's leases so far) than the cached prefix it gives up
(``reason="lease_room"``)."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

from engines.base import GenerateRequest, SamplingOptions
from gateway.core.config import RetentionSettings
from gateway.core.metrics import Metrics
from gateway.local.dispatch import Dispatcher
from gateway.local.pauses import SessionTurns
from gateway.local.replicas import Replica
from gateway.local.retention import BreakpointLeases
from gateway.local.routing import KvAware, RouteContext, Router
from gateway.local.spans import KVSpans
from manifest.hashing import block_hashes
from manifest.index import LocationId
from tests.unit.builders import booted
from tests.unit.local.fake_core import Clock, FakeCore

R0, R1 = LocationId("replica-0"), LocationId("replica-1")


class _Engine:
    ready = True


def _replicas(*loads: int) -> list[Replica]:
    out = []
    for i, n in enumerate(loads):
        r = Replica(LocationId(f"replica-{i}"), _Engine(), None, None)  # type: ignore[arg-type]
        r.inflight = n
        out.append(r)
    return out


def _ctx(predicted: dict[LocationId, int], need: int, room: dict[LocationId, int]) -> RouteContext:
    return RouteContext(predicted, lease_tokens=need, lease_room=room)


def test_a_new_session_leaves_a_replica_whose_budget_is_taken() -> None:
    a, b = _replicas(0, 0)
    kv = KvAware()
    # a holds 256 tokens of the prompt; its budget keeps 512 of the 4,096 the session
    # will lease, b's all of them: 3,584 kept against 256 prefilled now
    d = kv.choose([a, b], _ctx({a.id: 256, b.id: 0}, 4096, {a.id: 512, b.id: 6000}))
    assert (d.replica, d.reason) == (b, "lease_room")
    # room on both: the prefix decides
    d = kv.choose([a, b], _ctx({a.id: 256, b.id: 0}, 4096, {a.id: 4096, b.id: 6000}))
    assert (d.replica, d.reason) == (a, "longest_prefix")
    # the prefix given up outweighs the lease kept
    d = kv.choose([a, b], _ctx({a.id: 3840, b.id: 0}, 4096, {a.id: 512, b.id: 6000}))
    assert (d.replica, d.reason) == (a, "longest_prefix")
    # no more room elsewhere (a budget over-spent counts as none)
    d = kv.choose([a, b], _ctx({a.id: 256, b.id: 0}, 4096, {a.id: -300, b.id: 0}))
    assert (d.replica, d.reason) == (a, "longest_prefix")


def test_the_load_guard_and_known_homes_come_first() -> None:
    a, b = _replicas(0, 6)
    kv = KvAware(imbalance=4)
    d = kv.choose([a, b], _ctx({a.id: 256, b.id: 0}, 4096, {a.id: 512, b.id: 6000}))
    assert (d.replica, d.reason) == (a, "longest_prefix")  # b is out of balance
    a, b = _replicas(0, 0)
    ctx = RouteContext(
        {a.id: 256, b.id: 256}, session=a.id, lease_tokens=4096, lease_room={a.id: 0, b.id: 6000}
    )
    assert kv.choose([a, b], ctx).reason == "session"  # its own spans are there


def test_a_cold_prefix_goes_where_the_budget_has_room() -> None:
    a, b = _replicas(0, 0)
    kv = KvAware()
    for affinity in range(20):  # whichever the rendezvous hash would pick
        ctx = RouteContext(
            {a.id: 0, b.id: 0}, affinity, lease_tokens=1024, lease_room={a.id: 128, b.id: 2048}
        )
        assert kv.choose([a, b], ctx).replica is b


def test_the_tenants_leases_give_a_new_sessions_expected_size(tmp_path: Path) -> None:
    clock = Clock()
    hashes = block_hashes(list(range(16 * 12)), 16, "0")
    kv = KVSpans(16, "0", pin_max_share=0.75, default_lease_s=60, clock=clock)
    kv.attach(R0, FakeCore(hashes, capacity=12, num_blocks=16), f"ipc://{tmp_path}/e", None)
    kv.index.apply_stored(R0, hashes)
    turns = SessionTurns(RetentionSettings(quantile=0.9), BreakpointLeases(), clock)

    async def main() -> None:
        assert turns.lease_blocks("t") == 0  # none yet: the prompt's own blocks
        for i, n in enumerate([2, 4, 6, 8, 10]):
            turns.began(f"t:{i}", "t")
            await turns.ended(kv, f"t:{i}", R0, hashes[:n], called_tools=True)
        assert turns.lease_blocks("t") == 10
        assert turns.lease_blocks("other") == 0
        off = SessionTurns(RetentionSettings(enabled=False), BreakpointLeases(), clock)
        assert off.lease_blocks("t") is None
        await kv.close()

    asyncio.run(main())


def test_the_dispatcher_weighs_the_pin_budget_left_on_each_replica(tmp_path: Path) -> None:
    """Replica 0 holds the agent type's 2 prefix blocks and a paused session's 6-block
    lease (a budget of 9 of 12 blocks: 3 left); a new session expected to lease 8 blocks
    goes to replica 1, where all 8 fit, and gives up 32 cached tokens for it."""
    hashes = block_hashes(list(range(16 * 12)), 16, "0")
    decisions: Counter[tuple[str, str]] = Counter()

    async def main() -> tuple[str, str]:
        kv = KVSpans(16, "0", pin_max_share=0.75, default_lease_s=60)
        for r in (R0, R1):
            kv.attach(r, FakeCore(hashes, capacity=9, num_blocks=12), f"ipc://{tmp_path}/{r}", None)
        kv.index.apply_stored(R0, hashes[:8])
        await kv.pin(R0, hashes[2:8], "session:t:paused", 60)
        router = Router(count=lambda p, r: decisions.update([(p, r)]))
        dispatcher = Dispatcher(booted(_replicas(0, 0), kv), router, Metrics(), max_inflight=8)
        prompt = tuple(range(16 * 2)) + tuple(range(5000, 5000 + 16 * 4 + 5))
        greq = GenerateRequest("r", prompt, SamplingOptions(max_tokens=8))
        plain = await dispatcher.route(greq, None)
        dispatcher.prefills.finish(plain.prefill)  # else the next would wait to read it
        placed = await dispatcher.route(greq, None, lease_blocks=8)
        await kv.close()
        return plain.replica_id, placed.replica_id

    assert asyncio.run(main()) == (R0, R1)
    assert decisions == {("kv", "longest_prefix"): 1, ("kv", "lease_room"): 1}
