"""Running prefills by replica: the one a new prompt overlaps most, and its end."""

from __future__ import annotations

import asyncio

from gateway.local.prefills import Prefills
from manifest.hashing import BlockHash, block_hashes
from manifest.index import LocationId

A, B = LocationId("replica-0"), LocationId("replica-1")
SHARED = list(range(64))  # four blocks of 16


def _hashes(tail: int) -> list[BlockHash]:
    return block_hashes([*SHARED, *range(tail, tail + 32)], 16, "0")


def test_the_longest_overlap_per_replica_and_its_end() -> None:
    async def main() -> None:
        ps = Prefills()
        one = ps.start(A, _hashes(1000))
        two = ps.start(B, _hashes(1000)[:5])
        assert one is not None and two is not None and len(ps) == 2
        mine = _hashes(2000)  # shares the four SHARED blocks, not the tail
        over = ps.overlap(mine)
        assert {r: n for r, (n, _) in over.items()} == {A: 4, B: 4}
        assert ps.overlap(_hashes(1000))[A] == (6, one)  # the same prompt: every block
        assert ps.overlap(block_hashes(list(range(500, 600)), 16, "0")) == {}
        waiter = asyncio.create_task(one.done.wait())
        ps.finish(one)
        await asyncio.wait_for(waiter, 1)  # whoever waited on it wakes
        ps.finish(one)  # twice is once
        assert A not in ps.overlap(mine) and len(ps) == 1
        assert ps.start(A, []) is None  # a prompt shorter than a block is nobody's prefix

    asyncio.run(main())


def test_a_prefill_that_never_ran_is_forgotten_after_its_age() -> None:
    async def main() -> None:
        now = [100.0]
        ps = Prefills(max_age_s=30.0, clock=lambda: now[0])
        ps.start(A, _hashes(1000))  # routed, then its request failed before the engine
        assert A in ps.overlap(_hashes(1000))
        now[0] += 31
        assert ps.overlap(_hashes(1000)) == {} and len(ps) == 0

    asyncio.run(main())
