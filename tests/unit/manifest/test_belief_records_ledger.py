"""Verify, then account: belief folds telemetry, records verify markers, the ledger credits."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from manifest.belief import FoldResult, Telemetry, WarmthBelief, first_difference
from manifest.identity import content_digest, prefix_digests
from manifest.ledger import PriceTable, SavingsLedger
from manifest.records import (
    DropReason,
    MarkerAt,
    MarkerRecord,
    RenderRecord,
    Verified,
    make_record,
    verify,
)

ANCHOR = b'{"system":"You are a careful assistant."}\n'
DIGEST = content_digest(ANCHOR)
TARGET = "anthropic:claude-sonnet-4-6"


def test_probability_decays_step_or_exponential() -> None:
    b = WarmthBelief()
    b.record_warm(TARGET, DIGEST, 1200, ANCHOR, now=0, ttl_s=300, exact_ttl=True)
    assert b.probability(TARGET, DIGEST, 299) == 1.0
    assert b.probability(TARGET, DIGEST, 300) == 0.0
    b.record_warm("openai:gpt-5", DIGEST, 1200, ANCHOR, now=0, ttl_s=300, exact_ttl=False)
    assert b.probability("openai:gpt-5", DIGEST, 300) == pytest.approx(math.exp(-1))
    assert b.probability("nowhere", DIGEST, 0) == 0.0
    assert b.expire(now=10_000) == 2 and len(b) == 0


def test_read_refreshes_and_cold_read_of_believed_warm_is_broken_at_the_offset() -> None:
    b = WarmthBelief()
    b.record_warm(TARGET, DIGEST, 1200, ANCHOR, now=0, ttl_s=300, exact_ttl=True)
    hit = b.fold(Telemetry(TARGET, DIGEST, 1200, cached_tokens=1200, sent=ANCHOR, now=200))
    assert hit == FoldResult(believed_warm=True, confirmed=True, broken_at=None, false_warm=False)
    entry = b.get(TARGET, DIGEST)
    assert entry is not None and (entry.last_warmed, entry.observed_cached) == (200, 1200)

    stamped = ANCHOR.replace(b"careful", b"careful 12:00:01")
    miss = b.fold(Telemetry(TARGET, DIGEST, 1200, cached_tokens=0, sent=stamped, now=300))
    assert miss == FoldResult(True, False, ANCHOR.index(b"careful") + 8, True)
    assert b.probability(TARGET, DIGEST, 301) == 0.0
    assert b.false_warm_count == 1
    # a later confirmed read heals it
    b.fold(Telemetry(TARGET, DIGEST, 1200, cached_tokens=1300, sent=ANCHOR, now=400))
    assert b.probability(TARGET, DIGEST, 401) == 1.0


def test_unknown_prefix_confirmed_by_telemetry_becomes_believed() -> None:
    b = WarmthBelief()
    r = b.fold(Telemetry("deepseek:chat", DIGEST, 64, cached_tokens=64, sent=ANCHOR, now=5))
    assert r == FoldResult(False, True, None, False)
    assert b.probability("deepseek:chat", DIGEST, 5) == 1.0


def test_first_difference() -> None:
    assert first_difference(b"abc", b"abc") is None
    assert first_difference(b"abc", b"abd") == 2
    assert first_difference(b"ab", b"abc") == 2


RENDERED = b"TOOLS|SYSTEM|USER1|ASSISTANT1|USER2"


def markers_of(rendered: bytes) -> dict[str, MarkerAt]:
    ends = {"system": rendered.index(b"|USER1"), "message:1": rendered.index(b"|USER2")}
    tokens = {"system": 1500, "message:1": 2600}
    return {k: MarkerAt(k, v, tokens[k]) for k, v in ends.items()}


def test_verify_keeps_only_markers_whose_prefix_renders_the_same() -> None:
    rec = make_record("req-1", TARGET, RENDERED, list(markers_of(RENDERED).values()))
    same = verify(rec, RENDERED + b"|MORE", markers_of(RENDERED + b"|MORE"))
    assert [m.identity for m in same.kept] == ["system", "message:1"]
    assert same.creditable_tokens == 2600

    edited = RENDERED.replace(b"ASSISTANT1", b"ASSISTANT!")  # an edit in place under the same key
    changed = verify(rec, edited, markers_of(edited))
    assert [m.identity for m in changed.kept] == ["system"]
    assert [(m.identity, why) for m, why in changed.dropped] == [("message:1", "changed")]
    assert changed.creditable_tokens == 1500

    gone = verify(rec, RENDERED, {"system": markers_of(RENDERED)["system"]})
    assert [(m.identity, why) for m, why in gone.dropped] == [("message:1", "missing")]
    with pytest.raises(ValueError, match="outside"):
        make_record("r", TARGET, b"abc", [MarkerAt("x", 10, 1)])


def test_ledger_credits_only_verified_confirmed_tokens() -> None:
    rec = make_record("req-1", TARGET, RENDERED, list(markers_of(RENDERED).values()))
    edited = RENDERED.replace(b"ASSISTANT1", b"ASSISTANT!")
    ledger = SavingsLedger()
    prices = PriceTable(read_mult=0.1, write_mult=1.25)
    # the provider reports 2600 cached, but only 1500 verify: 1100 stay unverified
    c = ledger.credit_provider(TARGET, prices, 2600, 200, verify(rec, edited, markers_of(edited)))
    assert (c.confirmed_tokens, c.credited_tokens, c.unverified_tokens) == (2600, 1500, 1100)
    assert c.saved == pytest.approx(1500 * 0.9 - 200 * 0.25)
    ledger.credit_local("replica-0", 768)
    ledger.credit_local("replica-0", 256)
    assert ledger.local_reused == {"replica-0": 1024}  # kept apart from provider savings
    assert ledger.provider_saved() == pytest.approx(1300)
    ledger.check_integrity()
    ledger.providers[TARGET].credited = 99_999
    with pytest.raises(AssertionError, match="credited"):
        ledger.check_integrity()
    with pytest.raises(ValueError):
        PriceTable(read_mult=1.5, write_mult=1)
    with pytest.raises(ValueError):
        ledger.credit_local("r", -1)
    with pytest.raises(ValueError):
        ledger.credit_provider(TARGET, prices, -1, 0, verify(rec, RENDERED, markers_of(RENDERED)))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 3000), st.booleans()), max_size=40))
def test_credited_never_exceeds_confirmed(calls: list[tuple[int, int, bool]]) -> None:
    rec = make_record("r", TARGET, RENDERED, list(markers_of(RENDERED).values()))
    edited = RENDERED.replace(b"SYSTEM", b"SYSTEm")
    ledger = SavingsLedger()
    for cached, written, intact in calls:
        body = RENDERED if intact else edited
        ledger.credit_provider(
            TARGET, PriceTable(0.1, 1.25), cached, written, verify(rec, body, markers_of(body))
        )
        ledger.check_integrity()


def _byte_loop(a: bytes, b: bytes) -> int | None:
    """The reference: the first differing byte, one at a time."""
    for i in range(min(len(a), len(b))):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@given(st.binary(max_size=300), st.binary(max_size=40), st.binary(max_size=40))
@settings(max_examples=400)
def test_first_difference_matches_the_byte_loop(common: bytes, x: bytes, y: bytes) -> None:
    a, b = common + x, common + y
    assert first_difference(a, b) == _byte_loop(a, b)
    assert first_difference(memoryview(a), b) == _byte_loop(a, b)


def test_the_belief_keeps_at_most_max_entries_least_recently_warmed_out() -> None:
    belief = WarmthBelief(max_entries=3)
    d = [content_digest(f"p{i}".encode()) for i in range(5)]
    for i in range(3):
        belief.record_warm("t", d[i], 10, b"x", float(i), 300, True)
    belief.record_warm("t", d[0], 10, b"x", 3.0, 300, True)  # d0 warmed again: now newest
    belief.record_warm("t", d[3], 10, b"x", 4.0, 300, True)
    assert belief.take_evicted() == [("t", d[1])]
    assert belief.take_evicted() == []
    assert len(belief) == 3 and belief.get("t", d[1]) is None and belief.get("t", d[0])
    belief.fold(Telemetry("t", d[4], 10, 10, b"x", 5.0))  # a confirmed read adds one too
    assert belief.take_evicted() == [("t", d[2])]


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.lists(st.integers(0, 300)), st.binary(max_size=8))
def test_prefix_digests_equal_a_hash_per_prefix(data: bytes, ends: list[int], head: bytes) -> None:
    inside = [e for e in ends if e <= len(data)]
    got = prefix_digests(data, inside, head)
    assert got == {e: content_digest(head + data[:e]) for e in inside}
    if len(inside) < len(ends):
        with pytest.raises(ValueError, match="outside"):
            prefix_digests(data, ends, head)


def _verify_one_by_one(record: RenderRecord, rendered: bytes, at: dict[str, MarkerAt]) -> Verified:
    """Seed 002's definition, a hash per marker: the oracle for :func:`verify`."""
    kept: list[MarkerRecord] = []
    dropped: list[tuple[MarkerRecord, DropReason]] = []
    for m in record.markers:
        now = at.get(m.identity)
        if now is None:
            dropped.append((m, "missing"))
        elif now.end_byte != m.prefix_bytes or content_digest(rendered[: now.end_byte]) != (
            m.prefix_sha256
        ):
            dropped.append((m, "changed"))
        else:
            kept.append(m)
    return Verified(tuple(kept), tuple(dropped))


@settings(max_examples=200, deadline=None)
@given(
    st.binary(min_size=1, max_size=120),
    st.binary(max_size=120),
    st.lists(st.tuples(st.sampled_from("abcde"), st.integers(0, 130)), max_size=6),
)
def test_verify_matches_hashing_each_marker(
    sent: bytes, now: bytes, moves: list[tuple[str, int]]
) -> None:
    """Markers recorded on one rendering, checked against another: moved, missing, past
    the end, sharing an end byte."""
    at_sent = {k: MarkerAt(k, i * len(sent) // 5, i) for i, k in enumerate("abcde")}
    record = make_record("r", "t", sent, list(at_sent.values()))
    at_now = {k: MarkerAt(k, end, 0) for k, end in moves}
    assert verify(record, now, at_now) == _verify_one_by_one(record, now, at_now)
    assert verify(record, sent, at_sent).kept == record.markers
