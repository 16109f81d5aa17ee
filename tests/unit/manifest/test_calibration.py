"""The calibration fits: searches, the cache step, profiles as data."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from manifest.calibration import CalibratedProfile, Search, apply, fit_granularity
from manifest.planner import anthropic_profile, openai_profile


def _run(search: Search, threshold: float) -> int:
    probes = 0
    while (v := search.next()) is not None:
        search.record(v, v >= threshold)
        probes += 1
    return probes


@given(st.integers(min_value=1, max_value=500_000))
def test_the_integer_search_finds_the_exact_threshold(threshold: int) -> None:
    s = Search(start=2048, cap=1_000_000)
    probes = _run(s, threshold)
    assert s.ok == threshold and s.estimate == threshold
    assert probes <= 45


@given(st.floats(min_value=1.0, max_value=100_000.0))
def test_the_real_search_brackets_within_its_precision(threshold: float) -> None:
    s = Search(start=60, cap=172_800, integer=False, precision=0.04)
    _run(s, threshold)
    assert s.estimate is not None
    assert abs(s.estimate - threshold) / threshold < 0.04


def test_a_search_that_always_succeeds_shrinks_to_the_bottom() -> None:
    s = Search(start=2048, cap=10_000)
    _run(s, 0)
    assert s.ok == 1 and s.fail is None


def test_a_search_that_never_succeeds_stops_at_its_cap() -> None:
    s = Search(start=10, cap=100)
    assert _run(s, 1e9) == 5  # 10, 20, 40, 80, 100
    assert s.ok is None and s.estimate is None


def test_granularity_is_the_gcd_past_the_minimum() -> None:
    assert fit_granularity([1024, 1152, 1408, 1536], 1024) == 128
    assert fit_granularity([64, 192, 256], 64) == 64
    assert fit_granularity([64, 192, 320], 64) == 128  # even multiples only: sample more sizes
    assert fit_granularity([1024, 1024], 1024) is None


def test_a_profile_round_trips_and_replaces_the_documented_rules() -> None:
    cal = CalibratedProfile(
        "anthropic/claude-sonnet-4-5", 2048, 1, 421.5, 5390.0, True, 60, 1.0, ("n",)
    )
    assert CalibratedProfile.from_json(cal.to_json()) == cal
    p = apply(anthropic_profile("claude-sonnet-4-5"), cal)
    assert (p.min_prefix_tokens, p.granularity, p.ttl_options_s) == (2048, 1, (422, 5390))
    implicit = CalibratedProfile("openai/gpt-5", 1536, 256, 540.0, None, False, 40, 1.0)
    q = apply(openai_profile("gpt-5"), implicit)
    assert (q.min_prefix_tokens, q.granularity, q.ttl_options_s) == (1536, 256, ())


def test_a_bad_profile_is_refused() -> None:
    with pytest.raises(TypeError):
        CalibratedProfile.from_json('{"target": "x"}')
