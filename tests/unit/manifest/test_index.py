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


changes = st.lists(
    st.tuples(
        st.booleans(),
        st.lists(st.one_of(st.integers(0, 12), st.integers(0, 2**64 - 1)), max_size=20),
    ),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(before=changes, pinned=st.lists(st.integers(0, 12), max_size=6), batch=changes)
def test_a_batch_of_changes_folds_as_its_changes_one_by_one(
    before: list[tuple[bool, list[int]]],
    pinned: list[int],
    batch: list[tuple[bool, list[int]]],
) -> None:
    """``apply_changes`` (an engine step's events at once) leaves the table, the counts
    and the pins as ``apply_stored``/``apply_removed`` one change at a time, and its
    events total the same blocks: with and without a block both stored and removed."""
    one, lot = PrefixIndex(), PrefixIndex()
    for idx in (one, lot):
        idx.apply_stored(B, [5, 6])  # another location's bit on shared keys
        for is_stored, hs in before:
            (idx.apply_stored if is_stored else idx.apply_removed)(A, hs)
        idx.pin(A, pinned)
        idx.take_events()
    added = removed = 0
    for is_stored, hs in batch:
        if is_stored:
            added += one.apply_stored(A, hs)
        else:
            removed += one.apply_removed(A, hs)
    assert lot.apply_changes(A, batch) == (added, removed)
    totals: dict[str, int] = {}
    for ev in one.take_events():
        totals[ev.kind] = totals.get(ev.kind, 0) + ev.blocks
    got: dict[str, int] = {}
    for ev in lot.take_events():
        got[ev.kind] = got.get(ev.kind, 0) + ev.blocks
    assert got == totals
    probe = [*range(13), 2**40, 0]
    for loc in (A, B):
        assert lot.counts(loc) == one.counts(loc)
        for h in probe:
            assert lot.is_pinned(loc, h) == one.is_pinned(loc, h)
    assert [lot.match([h]) for h in probe] == [one.match([h]) for h in probe]
    assert len(lot) == len(one)
    lot.check_integrity()


def test_a_batch_in_one_insert_unless_a_block_is_stored_and_removed_in_it() -> None:
    idx = PrefixIndex()
    idx.apply_stored(A, [1, 2, 3])
    idx.pin(A, [3])
    idx.take_events()
    # a step's new blocks and the ones it evicted: disjoint
    assert idx.apply_changes(A, [(True, [4, 5]), (False, [1]), (False, [3]), (True, [6])]) == (
        3,
        2,
    )
    assert idx.take_events() == [
        IndexEvent("stored", A, 3),
        IndexEvent("removed", A, 2),
        IndexEvent("pin_lost", A, 1),
    ]
    # evicted, then stored again in the same step: the order decides
    assert idx.apply_changes(A, [(False, [4]), (True, [4]), (True, [7]), (False, [7])]) == (
        2,
        2,
    )
    assert idx.match([4]) == {A: 1} and idx.match([7]) == {A: 0}
    assert idx.apply_changes(A, []) == (0, 0) and idx.take_events()[-2:] == [
        IndexEvent("stored", A, 2),
        IndexEvent("removed", A, 2),
    ]
    idx.check_integrity()
