"""The prefix index against a brute-force reference, under random event streams."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from manifest.hashing import block_hashes, event_hash
from manifest.index import IndexEvent, LocationCounts, LocationId, PrefixIndex

A, B, C = LocationId("replica-a"), LocationId("replica-b"), LocationId("replica-c")
LOCS = [A, B, C]


def test_narrated_scenario() -> None:
    idx = PrefixIndex()
    prompt = block_hashes(list(range(64)), 16, "0")  # 4 blocks
    assert idx.apply_stored(A, prompt) == 4
    assert idx.apply_stored(B, prompt[:2]) == 2
    assert idx.match(prompt) == {A: 4, B: 2}
    assert idx.pin(A, prompt[:2]) == 2
    assert idx.counts(A) == LocationCounts(resident=4, pinned=2, evictable=2)
    assert idx.apply_removed(A, [prompt[1]]) == 1  # a hole: A now serves only block 0
    assert idx.match(prompt) == {A: 1, B: 2}
    assert idx.counts(A) == LocationCounts(resident=3, pinned=1, evictable=2)
    assert idx.apply_cleared(B) == 2
    assert idx.match(prompt) == {A: 1, B: 0}
    assert idx.take_events() == [
        IndexEvent("stored", A, 4),
        IndexEvent("stored", B, 2),
        IndexEvent("pinned", A, 2),
        IndexEvent("removed", A, 1),
        IndexEvent("pin_lost", A, 1),
        IndexEvent("cleared", B, 2),
    ]
    assert idx.take_events() == []
    idx.check_integrity()


def test_event_hash_and_full_hash_are_the_same_key() -> None:
    idx = PrefixIndex()
    h = block_hashes(list(range(16)), 16, "0")
    idx.apply_stored(A, [event_hash(h[0])])
    assert idx.match(h) == {A: 1}


def test_pins_are_counted_and_only_on_resident_blocks() -> None:
    idx = PrefixIndex()
    idx.apply_stored(A, [1, 2])
    assert idx.pin(A, [1, 1, 3]) == 2  # block 3 is not resident
    assert idx.unpin(A, [1]) == 1
    assert idx.is_pinned(A, 1)
    assert idx.unpin(A, [1, 1]) == 1  # the second release finds no pin
    assert not idx.is_pinned(A, 1)
    idx.check_integrity()


def test_remove_location_frees_its_bit() -> None:
    idx = PrefixIndex()
    idx.apply_stored(A, [1])
    idx.apply_stored(B, [1])
    idx.remove_location(A)
    idx.apply_stored(C, [2])  # reuses A's bit
    assert idx.locations == [B, C]
    assert idx.match([1]) == {B: 1, C: 0}
    assert len(idx) == 2
    idx.check_integrity()


def test_integrity_detects_corruption() -> None:
    idx = PrefixIndex()
    idx.apply_stored(A, [1, 2])
    idx._locations[A].resident = 5
    with pytest.raises(AssertionError, match="resident"):
        idx.check_integrity()


ops = st.lists(
    st.tuples(
        st.sampled_from(["stored", "removed", "cleared", "pin", "unpin"]),
        st.sampled_from(LOCS),
        st.lists(st.integers(0, 12), max_size=6),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, probe=st.lists(st.integers(0, 12), max_size=10))
def test_random_streams_keep_integrity_and_match_reference(
    ops: list[tuple[str, LocationId, list[int]]], probe: list[int]
) -> None:
    idx = PrefixIndex()
    ref: dict[LocationId, set[int]] = {loc: set() for loc in LOCS}
    pins: dict[LocationId, dict[int, int]] = {loc: {} for loc in LOCS}
    for loc in LOCS:
        idx.add_location(loc)
    for kind, loc, hs in ops:
        if kind == "stored":
            idx.apply_stored(loc, hs)
            ref[loc] |= set(hs)
        elif kind == "removed":
            idx.apply_removed(loc, hs)
            ref[loc] -= set(hs)
            for h in hs:
                pins[loc].pop(h, None)
        elif kind == "cleared":
            idx.apply_cleared(loc)
            ref[loc].clear()
            pins[loc].clear()
        elif kind == "pin":
            idx.pin(loc, hs)
            for h in hs:
                if h in ref[loc]:
                    pins[loc][h] = pins[loc].get(h, 0) + 1
        else:
            idx.unpin(loc, hs)
            for h in hs:
                if pins[loc].get(h, 0) > 1:
                    pins[loc][h] -= 1
                else:
                    pins[loc].pop(h, None)
        idx.check_integrity()
    for loc in LOCS:
        n = 0
        while n < len(probe) and probe[n] in ref[loc]:
            n += 1
        assert idx.match(probe)[loc] == n
        assert idx.counts(loc) == LocationCounts(
            len(ref[loc]), len(pins[loc]), len(ref[loc]) - len(pins[loc])
        )
    assert len(idx) == len(set().union(*ref.values()))
