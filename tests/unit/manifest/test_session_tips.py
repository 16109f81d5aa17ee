"""A paused session's tip: ride, lazy, heartbeat or the long tier, by what the pause is
expected to cost."""

from __future__ import annotations

import pytest

from manifest.governor import Economics, TtlOption
from manifest.session_tips import Gaps, TipPlan, heartbeats_needed, tip_costs, tip_plan

# Anthropic's explicit cache: 5 minutes at 1.25, 1 hour at 2.0, reads at 0.1
ANTHROPIC = Economics(0.1, (TtlOption(300, 1.25), TtlOption(3600, 2.0)), 1.0)
# an implicit cache (OpenAI): one TTL, the write is the request itself, reads at 0.5
OPENAI = Economics(0.5, (TtlOption(300, 1.0),), 1.0, writes_billed=False)


def test_heartbeats_needed_keep_it_warm_through_the_gap() -> None:
    assert heartbeats_needed(200, 300, 0.8) == 0  # back within the TTL
    assert heartbeats_needed(360, 300, 0.8) == 1  # one read at 240 s: warm to 540 s
    assert heartbeats_needed(540, 300, 0.8) == 1
    assert heartbeats_needed(541, 300, 0.8) == 2


def test_back_within_the_ttl_it_rides() -> None:
    assert tip_plan(120, ANTHROPIC, 0.8) is TipPlan.RIDE
    assert tip_costs(120, ANTHROPIC, 0.8) == {TipPlan.RIDE: 0.0}


def test_a_pause_just_past_the_ttl_is_one_heartbeat() -> None:
    costs = tip_costs(360, ANTHROPIC, 0.8)
    assert costs[TipPlan.LAZY] == pytest.approx(1.25 - 0.1 + 1.0)
    assert costs[TipPlan.LONG] == pytest.approx(0.75)
    assert costs[TipPlan.HEARTBEAT] == pytest.approx(0.1)
    assert tip_plan(360, ANTHROPIC, 0.8) is TipPlan.HEARTBEAT


def test_a_long_pause_takes_the_hour_tier_and_a_longer_one_is_left_cold() -> None:
    assert tip_plan(50 * 60, ANTHROPIC, 0.8) is TipPlan.LONG  # 12 reads (1.2) > 0.75
    # past the hour: 29 reads (2.9) cost more than writing it again (2.15)
    assert tip_plan(2 * 3600, ANTHROPIC, 0.8) is TipPlan.LAZY


def test_the_shadow_price_of_a_request_makes_heartbeats_dearer() -> None:
    assert tip_plan(360, ANTHROPIC, 0.8, shadow=1.0) is TipPlan.LONG  # 1.1 > 0.75


def test_an_implicit_cache_heartbeats_or_lets_go() -> None:
    assert tip_costs(360, OPENAI, 0.8)[TipPlan.LAZY] == pytest.approx(1.0 - 0.5 + 1.0)
    assert TipPlan.LONG not in tip_costs(360, OPENAI, 0.8)  # one tier only
    assert tip_plan(360, OPENAI, 0.8) is TipPlan.HEARTBEAT
    assert tip_plan(3600, OPENAI, 0.8) is TipPlan.LAZY  # 14 reads at 0.5


def test_gaps_keep_the_most_recent_and_give_quantiles() -> None:
    g = Gaps()
    assert g.quantile(0.9) is None
    for s in range(1, 101):
        g.add(float(s))
    assert len(g) == 64  # the most recent: 37..100
    assert g.quantile(0.5) == 68.0 and g.quantile(0.9) == 94.0
