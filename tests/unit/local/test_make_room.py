"""A paused session's lease never keeps a live request waiting: when the blocks pinned
on a replica for others and a request's own need exceed the engine's KV, paused
sessions' leases there give way, those in overtime first (the most overdue), then those
due the latest (``SessionTurns.make_room``, called by the dispatcher before a request
starts)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from engines.base import GenerateRequest, SamplingOptions
from engines.fake import FakeEngine, Hold
from engines.tokenizer import ChatTokenizer
from gateway.core.config import RetentionSettings
from gateway.core.metrics import Metrics
from gateway.local import room
from gateway.local.dispatch import Dispatch, Dispatcher
from gateway.local.pauses import SessionTurns
from gateway.local.replicas import Replica
from gateway.local.retention import BreakpointLeases
from gateway.local.routing import Router
from gateway.local.spans import KVSpans
from manifest.hashing import BlockHash, block_hashes
from manifest.index import LocationId
from tests.unit.builders import booted
from tests.unit.local.fake_core import Clock, FakeCore
from tests.unit.waits import until

R = LocationId("replica-0")
HASHES = block_hashes(list(range(192)), 16, "0")  # 12 blocks
TOTAL = 12  # the engine's KV blocks


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[tuple[KVSpans, FakeCore, Clock, SessionTurns]]:
    clock = Clock()
    kv = KVSpans(16, "0", pin_max_share=0.75, default_lease_s=60, clock=clock)
    core = FakeCore(HASHES, capacity=9, num_blocks=TOTAL)
    kv.attach(R, core, f"ipc://{tmp_path}/none", None)
    kv.index.apply_stored(R, HASHES)
    cfg = RetentionSettings(default_gap_s=30, margin=1.5, min_lease_s=5, max_lease_s=120)
    yield kv, core, clock, SessionTurns(cfg, BreakpointLeases(), clock)
    asyncio.run(kv.close())


async def _pause(turns: SessionTurns, kv: KVSpans, key: str, blocks: slice) -> None:
    turns.began(key, "t")
    assert await turns.ended(kv, key, R, HASHES[blocks], called_tools=True) == "leased"


def test_the_session_due_latest_gives_way_until_the_request_fits(setup: Any) -> None:
    kv, core, clock, turns = setup

    async def main() -> None:
        await _pause(turns, kv, "t:a", slice(0, 3))  # due at +45 s
        clock.now += 1
        await _pause(turns, kv, "t:b", slice(3, 6))  # due at +46 s: the latest
        clock.now += 1
        await _pause(turns, kv, "t:c", slice(6, 9))  # due at +47 s
        assert len(core.pins) == 9
        # 9 pinned for others + 6 needed > 12: one session's 3 blocks are enough
        assert await turns.make_room(kv, R, HASHES[9:11], 6) == 1
        assert kv.pin_owners(R, HASHES[6]) == [] and len(core.pins) == 6
        assert kv.pin_owners(R, HASHES[3]) == ["session:t:b"]  # the others keep theirs
        # what fits takes nothing
        assert await turns.make_room(kv, R, HASHES[9:11], 6) == 0
        assert len(core.pins) == 6
        # a need beyond them all takes them all, the latest due first
        assert await turns.make_room(kv, R, HASHES[9:11], 12) == 2
        assert core.pins == set()

    asyncio.run(main())
    assert turns.counts == {"leased": 3, "yielded": 3}


def test_overtime_first_the_most_overdue_first(setup: Any) -> None:
    kv, _core, clock, turns = setup

    async def main() -> None:
        await _pause(turns, kv, "t:a", slice(0, 3))  # due at +45 s
        clock.now += 10
        await _pause(turns, kv, "t:b", slice(3, 6))  # due at +55 s
        clock.now += 40  # 50 s: a is in overtime, b is not due yet
        await _pause(turns, kv, "t:c", slice(6, 9))  # due at +95 s
        assert await turns.make_room(kv, R, HASHES[9:11], 6) == 1
        assert kv.pin_owners(R, HASHES[0]) == []  # a, overdue, went first
        assert kv.pin_owners(R, HASHES[3]) == ["session:t:b"]
        assert kv.pin_owners(R, HASHES[6]) == ["session:t:c"]

    asyncio.run(main())


def test_the_requests_own_pinned_blocks_are_not_in_its_way(setup: Any) -> None:
    kv, _core, _clock, turns = setup

    async def main() -> None:
        await _pause(turns, kv, "t:a", slice(0, 3))
        await _pause(turns, kv, "t:b", slice(3, 9))
        # a's next turn: its prompt is its leased blocks and one more, 10 blocks in all;
        # pinned for others: b's 6, and 6 + 10 > 12
        turns.began("t:a", "t")
        assert await turns.make_room(kv, R, HASHES[0:4], 10) == 1
        assert kv.pin_owners(R, HASHES[3]) == []  # b gave way
        assert kv.pin_owners(R, HASHES[0]) == ["session:t:a"]  # it reads them
        # another request that needs the whole cache: a's turn is on its way, and its lease
        # goes last, but it goes (the turn may wait behind that request for the blocks)
        assert await turns.make_room(kv, R, HASHES[9:11], 12) == 1
        assert kv.pin_owners(R, HASHES[0]) == []

    asyncio.run(main())


def test_leases_of_turns_on_their_way_go_after_paused_ones_never_the_requests_own(
    setup: Any,
) -> None:
    """A turn that waits in the engine's queue behind a request keeps its session's lease
    pinned; if that request needs those blocks, neither starts until the lease runs out.
    So when the paused sessions' leases are not enough, those of turns on their way go
    too, the latest begun first; never one holding the request's own prefix."""
    kv, core, clock, turns = setup

    async def main() -> None:
        await _pause(turns, kv, "t:mine", slice(0, 2))
        await _pause(turns, kv, "t:old", slice(2, 4))
        await _pause(turns, kv, "t:new", slice(4, 6))
        await _pause(turns, kv, "t:paused", slice(6, 8))
        for key in ("t:mine", "t:old", "t:new"):  # their next turns are on their way
            turns.began(key, "t")
            clock.now += 1
        # t:mine's turn: 2 blocks of its own; 6 pinned for others + 10 > 12
        assert await turns.make_room(kv, R, HASHES[0:2], 10) == 2
        assert kv.pin_owners(R, HASHES[6]) == []  # the paused one first
        assert kv.pin_owners(R, HASHES[4]) == []  # then the latest begun
        assert kv.pin_owners(R, HASHES[2]) == ["session:t:old"]
        # asked again for more: the next goes, never its own
        assert await turns.make_room(kv, R, HASHES[0:2], 12) == 1
        assert kv.pin_owners(R, HASHES[2]) == []
        assert kv.pin_owners(R, HASHES[0]) == ["session:t:mine"]
        assert core.pins == {bytes(h) for h in HASHES[0:2]}

    asyncio.run(main())
    assert turns.counts == {"leased": 4, "yielded": 3}


def test_leases_that_ended_or_other_replicas_are_not_counted(setup: Any) -> None:
    kv, _core, clock, turns = setup

    async def main() -> None:
        await _pause(turns, kv, "t:a", slice(0, 6))
        clock.now += 121  # past max_lease_s: the reaper releases it
        assert await kv.reap() == 6
        await _pause(turns, kv, "t:b", slice(6, 9))
        assert await turns.make_room(kv, LocationId("replica-1"), HASHES[9:11], 12) == 0
        assert await turns.make_room(kv, R, HASHES[9:11], 10) == 1  # b only
        assert turns.counts.get("yielded") == 1

    asyncio.run(main())


def test_nothing_gives_way_with_retention_off_or_no_block_count(setup: Any) -> None:
    kv, core, clock, turns = setup
    off = SessionTurns(RetentionSettings(enabled=False), BreakpointLeases(), clock)

    async def main() -> None:
        await _pause(turns, kv, "t:a", slice(0, 9))
        assert await off.make_room(kv, R, HASHES[9:11], 12) == 0
        core.num_blocks = None  # the engine cannot say how many blocks it has
        kv.state(R).num_blocks = None
        assert await turns.make_room(kv, R, HASHES[9:11], 12) == 0
        assert len(core.pins) == 9

    asyncio.run(main())


def test_the_dispatcher_makes_room_before_the_engine_hears_of_the_request(
    demo_model: Path, tmp_path: Path
) -> None:
    """Every local request asks for its room first: its prompt's full blocks and its
    longest answers (n x max_tokens), in the replica's blocks."""

    async def main() -> list[tuple[Any, ...]]:
        engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)))
        await engine.start()
        kv = KVSpans(16, "0", pin_max_share=0.5, default_lease_s=60)
        kv.attach(R, FakeCore([], capacity=4, num_blocks=TOTAL), f"ipc://{tmp_path}/e", None)
        replica = Replica(R, engine)
        asked: list[tuple[Any, ...]] = []

        async def room(k: KVSpans, r: LocationId, hashes: Sequence[BlockHash], need: int) -> int:
            asked.append((k is kv, r, list(hashes), need, len(engine.received)))
            return 0

        replicas = booted([replica], kv)
        dispatcher = Dispatcher(replicas, Router(), Metrics(), max_inflight=4, make_room=room)
        prompt = tuple(range(1, 41))  # 40 tokens: 2 full blocks of 16, 3 blocks held
        greq = GenerateRequest("r1", prompt, SamplingOptions(max_tokens=20, n=2))
        d = Dispatch(replica, R, None, HASHES[:2])
        async for _ in dispatcher.run(greq, d, "chat", 0.0):
            pass
        await kv.close()
        return asked

    # 3 blocks of prompt, 2 x 2 of answers; asked before the engine received it
    assert asyncio.run(main()) == [(True, R, HASHES[:2], 7, 0)]


def test_a_request_waiting_for_its_first_token_asks_for_room_again(
    demo_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sessions lease blocks at their turns' ends while a request waits in the engine's
    queue: until its first token, the request asks for its room again, every
    ``ROOM_CHECK_S``; after it, never.  (Here every turn of the loop: no clock, and a
    keeper left running would ask again at once.)"""
    monkeypatch.setattr(room, "ROOM_CHECK_S", 0.0)

    async def main() -> tuple[int, int]:
        hold = Hold(at=0)  # the request waits for its first token until it asked thrice
        engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)), hold=hold)
        await engine.start()
        kv = KVSpans(16, "0", pin_max_share=0.5, default_lease_s=60)
        kv.attach(R, FakeCore([], capacity=4, num_blocks=TOTAL), f"ipc://{tmp_path}/e", None)
        replica = Replica(R, engine)
        asked = 0

        async def room(k: KVSpans, r: LocationId, hashes: Sequence[BlockHash], need: int) -> int:
            nonlocal asked
            asked += 1
            return 0

        replicas = booted([replica], kv)
        dispatcher = Dispatcher(replicas, Router(), Metrics(), max_inflight=4, make_room=room)
        greq = GenerateRequest("r1", tuple(range(1, 41)), SamplingOptions(max_tokens=4))
        d = Dispatch(replica, R, None, HASHES[:2])
        at_first = 0

        async def asked_thrice() -> None:
            await until(lambda: asked >= 3, "room asked for again while the request waited")
            hold.release()

        release = asyncio.create_task(asked_thrice())
        async for _ in dispatcher.run(greq, d, "chat", 0.0):
            at_first = at_first or asked
        await release

        def keeping() -> bool:  # the room keeper of r1 still runs
            return any(t.get_name() == "room for r1" and not t.done() for t in asyncio.all_tasks())

        await until(lambda: not keeping(), "the room keeper ended at the first token")
        await kv.close()
        return at_first, asked

    at_first, in_all = asyncio.run(main())
    assert at_first > 2  # once before the engine heard of it, then while it waited
    assert in_all == at_first  # none after the first token
