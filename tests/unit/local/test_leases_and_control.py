"""The lease book (pure: times passed in) and the typed span-control client (one error
boundary for every engine-core call)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.errors import EngineError, EngineInputError, EngineUnavailable
from engines.vllm.span_control import PinReply, SpanControl
from gateway.local.leases import Lease, LeaseBook
from manifest.hashing import BlockHash
from manifest.index import LocationId

R = LocationId("replica-0")
H = [BlockHash(bytes([i]) * 32) for i in range(6)]


def test_leases_narrated() -> None:
    book = LeaseBook()
    book.add(R, H[:2])
    assert book.grant(R, H[0], Lease("alice", 100.0))
    assert book.grant(R, H[0], Lease("bob", 50.0))
    assert book.grant(R, H[0], Lease("alice", 200.0))  # renewing replaces alice's lease
    assert not book.grant(R, H[3], Lease("alice", 100.0))  # not pinned: no lease
    assert book.owners(R, H[0]) == ["bob", "alice"]
    assert book.release(R, [H[0]], "alice") == []  # bob still holds it
    assert book.expire(60.0) == {R: [H[0], H[1]]}  # bob's lease ended; H[1] had none
    assert len(book) == 0


def test_drop_forgets_a_replica() -> None:
    book = LeaseBook()
    book.add(R, H[:3])
    book.add(LocationId("replica-1"), H[:1])
    assert book.drop(R) == 3 and len(book) == 1


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "grant", "release", "release_all", "expire"]),
        st.integers(0, 5),
        st.sampled_from(["a", "b", "c"]),
        st.floats(0, 100),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_every_pinned_block_is_freed_exactly_once(seq: list[tuple[str, int, str, float]]) -> None:
    """Under any sequence of operations: one lease per owner and block, and a block is
    handed back to unpin exactly once per time it was pinned."""
    book, pinned, freed = LeaseBook(), 0, 0
    for op, i, owner, t in seq:
        h = H[i]
        if op == "add" and not book.pinned(R, h):
            book.add(R, [h])
            pinned += 1
        elif op == "grant":
            book.grant(R, h, Lease(owner, t))
        elif op == "release":
            freed += len(book.release(R, [h], owner))
        elif op == "release_all":
            freed += len(book.release(R, [h], None))
        elif op == "expire":
            freed += sum(len(v) for v in book.expire(t).values())
        book.check_integrity()
    assert pinned - freed == len(book)


class Core:
    def __init__(self, answer: Any = None, raises: BaseException | None = None) -> None:
        self.answer, self.raises = answer, raises
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    async def call_core(self, method: str, *args: Any) -> Any:
        self.calls.append((method, args))
        if self.raises is not None:
            raise self.raises
        return self.answer


def test_typed_calls_name_the_plugin_methods() -> None:
    async def main() -> None:
        core = Core({"pinned": [b"a"], "already": [], "missing": [b"b"], "refused": []})
        reply = await SpanControl(core).pin([b"a", b"b"], 0.5)
        assert reply == PinReply((b"a",), (), (b"b",), ())
        assert core.calls == [("vcache_pin", ([b"a", b"b"], 0.5, "", None))]
        core.answer = {"evicted": [b"a"], "busy": [b"b"]}
        assert await SpanControl(core).evict([b"a", b"b"]) == ((b"a",), (b"b",))
        core.answer = 7
        assert await SpanControl(core).barrier() == 7
        core.answer = [b"x"]
        assert await SpanControl(core).resident() == (b"x",)
        assert [m for m, _ in core.calls[1:]] == [
            "vcache_evict",
            "vcache_events_barrier",
            "vcache_resident",
        ]

    asyncio.run(main())


@pytest.mark.parametrize(
    "raised",
    [RuntimeError("EngineDeadError"), KeyError("x"), ValueError("bad reply"), OSError("pipe")],
)
def test_whatever_a_core_call_raises_is_an_engine_error(raised: Exception) -> None:
    async def main() -> None:
        with pytest.raises(EngineUnavailable):
            await SpanControl(Core(raises=raised)).unpin([b"a"])

    asyncio.run(main())


def test_engine_errors_pass_as_they_are_and_bad_replies_are_unavailable() -> None:
    async def main() -> None:
        with pytest.raises(EngineInputError):
            await SpanControl(Core(raises=EngineInputError("no"))).evict([b"a"])
        with pytest.raises(EngineUnavailable, match="answered list"):
            await SpanControl(Core(answer=[1, 2])).cache_stats()
        with pytest.raises(EngineUnavailable, match="vcache_pin answered"):
            await SpanControl(Core(answer={"pinned": []})).pin([b"a"], 0.5)
        with pytest.raises(EngineError):
            await SpanControl(Core(raises=TimeoutError())).barrier()

    asyncio.run(main())
