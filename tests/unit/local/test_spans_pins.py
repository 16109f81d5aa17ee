"""Pins have owners and leases: the engine holds a block while any lease is live."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.local.spans import KVSpans
from manifest.hashing import BlockHash, block_hashes
from manifest.index import LocationId
from tests.unit.local.fake_core import Clock, FakeCore
from tests.unit.waits import turns, until

R = LocationId("replica-0")
Setup = tuple[KVSpans, FakeCore, Clock, list[BlockHash]]


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[[int], Setup]]:
    """Build a manager over a fake core; its subscriber sockets are closed afterwards."""
    built: list[KVSpans] = []

    def build(capacity: int = 10) -> Setup:
        kv, core, clock, hashes = _setup(tmp_path, capacity)
        built.append(kv)
        return kv, core, clock, hashes

    yield build
    for kv in built:
        asyncio.run(kv.close())


def _setup(tmp_path: Path, capacity: int) -> Setup:
    hashes = block_hashes(list(range(64)), 16, "0")
    clock = Clock()
    kv = KVSpans(16, "0", pin_max_share=0.5, default_lease_s=60, clock=clock)
    core = FakeCore(hashes[:3], capacity)
    kv.attach(R, core, f"ipc://{tmp_path}/none", None)
    kv.index.apply_stored(R, hashes[:3])
    return kv, core, clock, hashes


def test_two_owners_hold_one_engine_pin_until_both_release(make: Callable[[int], Setup]) -> None:
    async def main() -> None:
        kv, core, _, hashes = make(10)
        a = await kv.pin(R, hashes[:2], "alice")
        b = await kv.pin(R, hashes[:2], "bob", lease_s=10)
        assert a.pinned == b.pinned == [h.hex() for h in hashes[:2]]
        assert core.calls == ["vcache_pin"]  # the second owner needs no engine call
        assert kv.pin_owners(R, hashes[0]) == ["alice", "bob"]
        assert kv.index.counts(R).pinned == 2
        assert await kv.unpin(R, hashes[:2], "alice") == []  # bob still holds them
        assert core.pins == {bytes(h) for h in hashes[:2]}
        assert await kv.unpin(R, hashes[:2], "bob") == [h.hex() for h in hashes[:2]]
        assert core.pins == set() and kv.index.counts(R).pinned == 0

    asyncio.run(main())


def test_missing_and_refused_are_reported(make: Callable[[int], Setup]) -> None:
    async def main() -> None:
        kv, _, _, hashes = make(1)
        res = await kv.pin(R, hashes[:4], "alice")
        assert res.pinned == [hashes[0].hex()]
        assert res.refused == [hashes[1].hex(), hashes[2].hex()]
        assert res.missing == [hashes[3].hex()]

    asyncio.run(main())


def test_expired_leases_are_reaped(make: Callable[[int], Setup]) -> None:
    async def main() -> None:
        kv, core, clock, hashes = make(10)
        await kv.pin(R, hashes[:1], "alice", lease_s=30)
        await kv.pin(R, hashes[1:2], "bob", lease_s=300)
        clock.now += 31
        assert await kv.reap() == 1
        assert core.pins == {bytes(hashes[1])}
        assert kv.pin_owners(R, hashes[0]) == []
        # renewing a lease extends it
        await kv.pin(R, hashes[1:2], "bob", lease_s=600)
        clock.now += 400
        assert await kv.reap() == 0
        clock.now += 201
        assert await kv.reap() == 1 and core.pins == set()

    asyncio.run(main())


def test_admin_unpin_releases_every_owner(make: Callable[[int], Setup]) -> None:
    async def main() -> None:
        kv, core, _, hashes = make(10)
        await kv.pin(R, hashes[:1], "alice")
        await kv.pin(R, hashes[:1], "bob")
        assert await kv.unpin(R, hashes[:1], None) == [hashes[0].hex()]
        assert core.pins == set()

    asyncio.run(main())


def test_a_resync_drops_leases_so_owners_can_pin_again(make: Callable[[int], Setup]) -> None:
    async def main() -> None:
        kv, core, _, hashes = make(10)
        await kv.pin(R, hashes[:2], "alice")
        core.pins.clear()  # the engine restarted: its pins are gone
        await kv.events.resync(R)
        assert kv.pin_owners(R, hashes[0]) == [] and kv.index.counts(R).pinned == 0
        again = await kv.pin(R, hashes[:2], "alice")
        assert again.pinned == [h.hex() for h in hashes[:2]]
        assert core.pins == {bytes(h) for h in hashes[:2]}  # the engine was asked again

    asyncio.run(main())


def test_predict_caps_at_whole_blocks_before_the_last_token(make: Callable[[int], Setup]) -> None:
    kv, _, _, hashes = make(10)
    assert kv.predict(hashes, 64) == {R: 48}  # 3 resident blocks of 16
    assert kv.predict(hashes, 33) == {R: 32}  # the last token is never served from cache
    assert kv.predict(hashes, 32) == {R: 16}


def test_the_index_queue_is_drained_into_counts(make: Callable[[int], Setup]) -> None:
    """Every change the manager makes leaves the index's event queue empty (it grew without
    bound before): the events are counted per (replica, kind) instead."""
    from engines.vllm.kv_events import BlockRemoved, BlockStored, EventBatch

    async def main() -> None:
        kv, _, _, hashes = make(10)
        more = block_hashes(list(range(1000, 1064)), 16, "0")
        for i in range(100):
            h = bytes(more[i % 4])
            kv.events.apply(R, EventBatch(ts=float(i), events=[BlockStored(block_hashes=[h])]))
            kv.events.apply(R, EventBatch(ts=float(i), events=[BlockRemoved(block_hashes=[h])]))
        await kv.pin(R, hashes[:2], "alice")
        await kv.unpin(R, hashes[:2], "alice")
        assert kv.index.take_events() == []
        assert kv.index_events[(R, "stored")] == 3 + 100  # the setup's 3 blocks, then ours
        assert kv.index_events[(R, "removed")] == 100
        assert kv.index_events[(R, "pinned")] == 2 and kv.index_events[(R, "unpinned")] == 2

    asyncio.run(main())


def test_a_batch_folds_in_order_around_a_cleared_cache(make: Callable[[int], Setup]) -> None:
    """One engine step's events at once: what comes before a cache clear is gone with it
    (and the replica's leases), what comes after is resident; counted per kind."""
    from engines.vllm.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        EventBatch,
        KVEvent,
    )

    async def main() -> None:
        kv, _, _, hashes = make(10)
        await kv.pin(R, hashes[:2], "alice")
        new = block_hashes(list(range(1000, 1064)), 16, "0")
        events: list[KVEvent] = [
            BlockStored(block_hashes=[bytes(new[0]), bytes(new[1])]),
            BlockRemoved(block_hashes=[bytes(hashes[0])]),
            AllBlocksCleared(),
            BlockStored(block_hashes=[bytes(new[2])]),
            BlockRemoved(block_hashes=[bytes(new[2])]),
            BlockStored(block_hashes=[bytes(new[3])]),
        ]
        kv.events.apply(R, EventBatch(ts=1.0, events=events))
        assert [kv.index.match([h])[R] for h in [*hashes[:3], *new]] == [0, 0, 0, 0, 0, 0, 1]
        assert kv.pin_owners(R, hashes[1]) == [] and kv.index.counts(R).pinned == 0
        assert kv.index_events[(R, "stored")] == 3 + 2 + 2  # the setup's 3, then 2 and 2
        assert kv.index_events[(R, "removed")] == 1 + 1
        assert kv.index_events[(R, "cleared")] == 4
        kv.index.check_integrity()

    asyncio.run(main())


def test_a_detached_replica_forgets_its_blocks_and_pins(make: Callable[[int], Setup]) -> None:
    async def main() -> None:
        kv, _, _, hashes = make(10)
        await kv.pin(R, hashes[:2], "alice")
        kv.detach(R)  # its engine died
        assert kv.index.counts(R) == (0, 0, 0) and kv.pin_owners(R, hashes[0]) == []
        assert not kv.is_exact(R) and kv.state(R).live is False
        await kv.sync()  # skips the dead replica's closed subscriber
        stats = await kv.stats()
        assert stats["replicas"][R]["live"] is False and stats["replicas"][R]["engine"] is None

    asyncio.run(main())


def test_two_gateways_on_one_replica_release_only_their_own_holds(tmp_path: Path) -> None:
    """Active-active: two gateways pin the same blocks on one engine; one releasing (or
    its leases running out) leaves the other's pins in place."""

    async def main() -> None:
        hashes = block_hashes(list(range(64)), 16, "0")
        core = FakeCore(hashes[:3], 10)
        clock = Clock()
        gateways = []
        for name in ("gw-a", "gw-b"):
            kv = KVSpans(16, "0", 0.5, default_lease_s=60, clock=clock, holder=name)
            kv.attach(R, core, f"ipc://{tmp_path}/{name}", None)
            kv.index.apply_stored(R, hashes[:3])
            gateways.append(kv)
        a, b = gateways
        await a.pin(R, hashes[:2], "session-1", lease_s=30)
        await b.pin(R, hashes[:2], "session-1", lease_s=90)
        assert core.holds == {bytes(h): {"gw-a", "gw-b"} for h in hashes[:2]}
        clock.now += 31
        assert await a.reap() == 2  # a's leases ran out: a lets go of its holds ...
        assert core.pins == {bytes(h) for h in hashes[:2]}  # ... b's keep the blocks
        assert a.index.counts(R).pinned == 0  # a's index counts its own pins only
        assert await b.unpin(R, hashes[:2], "session-1") == [h.hex() for h in hashes[:2]]
        assert core.pins == set() and b.index.counts(R).pinned == 0
        for kv in gateways:
            await kv.close()

    asyncio.run(main())


def test_a_lease_past_the_engine_hold_renews_it(make: Callable[[int], Setup]) -> None:
    async def main() -> None:
        kv, core, clock, hashes = make(10)
        await kv.pin(R, hashes[:1], "alice", lease_s=30)  # held for 30 s + slack
        await kv.pin(R, hashes[:1], "bob", lease_s=30)  # within the hold: no call
        assert core.calls == ["vcache_pin"]
        clock.now += 20
        await kv.pin(R, hashes[:1], "alice", lease_s=30)  # 50 s: past 30 + 10 slack
        assert core.calls == ["vcache_pin", "vcache_pin"]
        # a renewed hold is still one pin in the index: released, the block is unpinned
        assert kv.index.counts(R).pinned == 1
        assert await kv.unpin(R, hashes[:1], None) == [hashes[0].hex()]
        assert core.pins == set()
        assert kv.index.counts(R).pinned == 0 and not kv.index.is_pinned(R, hashes[0])

    asyncio.run(main())


class _SlowReplies(FakeCore):
    """A core that does each call at once but answers a pin only when told: the reply
    is on its way while the gateway goes on."""

    def __init__(self, resident: list[BlockHash], capacity: int) -> None:
        super().__init__(resident, capacity)
        self.answer = asyncio.Event()

    async def call_core(self, method: str, *args: object) -> object:
        out = await super().call_core(method, *args)
        if method == "vcache_pin":
            await self.answer.wait()
        return out


def test_a_release_never_unpins_a_block_whose_pin_is_on_its_way(tmp_path: Path) -> None:
    """alice's short lease holds a block; bob's longer one needs the engine's hold renewed.
    alice lets go while bob's pin is unanswered: the engine must keep the block, which the
    book now says bob holds."""

    async def main() -> None:
        hashes = block_hashes(list(range(64)), 16, "0")
        kv = KVSpans(16, "0", pin_max_share=0.5, default_lease_s=60, clock=Clock())
        core = _SlowReplies(hashes[:3], 10)
        kv.attach(R, core, f"ipc://{tmp_path}/none", None)
        kv.index.apply_stored(R, hashes[:3])
        core.answer.set()
        await kv.pin(R, hashes[:1], "alice", lease_s=5)
        core.answer.clear()
        bob = asyncio.create_task(kv.pin(R, hashes[:1], "bob", lease_s=600))
        # bob's renewal reached the engine; its answer has not
        await until(lambda: core.calls.count("vcache_pin") == 2, "bob's pin sent")
        alice = asyncio.create_task(kv.unpin(R, hashes[:1], "alice"))
        await turns()  # alice goes as far as she can meanwhile
        core.answer.set()
        await asyncio.gather(bob, alice)
        assert kv.pin_owners(R, hashes[0]) == ["bob"]
        assert core.pins == {bytes(hashes[0])}  # the engine agrees with the book
        await kv.close()

    asyncio.run(main())
