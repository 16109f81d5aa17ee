"""The governor's rule and its choice between TTL tiers."""

from __future__ import annotations

import math
import random

import pytest

from manifest.economics import zipf_fit
from manifest.governor import (
    ArrivalRate,
    Decision,
    Economics,
    TtlOption,
    cost_rate,
    decide,
    rule,
)

ANTHROPIC = Economics(read_mult=0.1, options=(TtlOption(300, 1.25), TtlOption(3600, 2.0)))
FIVE_MIN = Economics(read_mult=0.1, options=(TtlOption(300, 1.25),))


def test_the_rule_of_the_design_note() -> None:
    assert rule(1.0, 1.25, 1.0, 0.0) is Decision.RIDE
    threshold = math.log((1.25 + 0.0 + 1.0) / 1.0)  # ~0.81
    assert rule(threshold + 0.01, 1.25, 1.0, 0.0) is Decision.HEARTBEAT
    assert rule(threshold - 0.01, 1.25, 1.0, 0.0) is Decision.LAZY
    # a rate-limit shadow price raises the bar; no latency value: never pin
    assert rule(threshold + 0.01, 1.25, 1.0, 0.5) is Decision.LAZY
    assert rule(0.99, 1.25, 0.0, 0.0) is Decision.LAZY


def test_decisions_follow_the_arrival_rate() -> None:
    assert decide(1 / 60, FIVE_MIN).decision is Decision.RIDE  # λT = 5
    assert decide(0.9 / 300, FIVE_MIN).decision is Decision.HEARTBEAT
    assert decide(0.1 / 300, FIVE_MIN).decision is Decision.LAZY
    assert decide(0.0, FIVE_MIN).decision is Decision.EVICT
    assert decide(1 / 60, FIVE_MIN, idle_s=7200, horizon_s=3600).decision is Decision.EVICT


def test_the_one_hour_tier_wins_for_sparse_traffic_that_it_keeps_warm() -> None:
    # one request every 20 minutes: 5m misses every time, 1h rides
    v = decide(1 / 1200, ANTHROPIC)
    assert v.ttl_s == 3600 and v.decision is Decision.RIDE
    # one request every 5 hours, no latency value: the 1h write premium is not repaid
    plain = Economics(read_mult=0.1, options=ANTHROPIC.options, latency_value=0.0)
    v = decide(1 / 18_000, plain)
    assert v.ttl_s == 300 and v.decision is Decision.LAZY


def test_cost_rates_price_misses_reads_and_heartbeats() -> None:
    five = TtlOption(300, 1.25)
    rate = 1 / 600
    miss = math.exp(-rate * 300)
    lazy = cost_rate(Decision.LAZY, rate, five, FIVE_MIN, 0.0)
    assert lazy == pytest.approx(rate * (miss * 2.25 + (1 - miss) * 0.1))
    beat = cost_rate(Decision.HEARTBEAT, rate, five, FIVE_MIN, 0.2)
    assert beat == pytest.approx(rate * 0.1 + 0.3 / 300)
    free = Economics(read_mult=0.5, options=(five,), writes_billed=False)
    assert cost_rate(Decision.LAZY, rate, five, free, 0.0) == pytest.approx(
        rate * (miss * 2.0 + (1 - miss) * 0.5)
    )


def test_economics_are_checked() -> None:
    with pytest.raises(ValueError):
        Economics(read_mult=0.1, options=())
    with pytest.raises(ValueError):
        Economics(read_mult=1.5, options=(TtlOption(300, 1.25),))


def test_the_arrival_rate_is_counted_over_its_horizon() -> None:
    a = ArrivalRate.empty(horizon_s=600, floor_s=60)
    assert a.rate(0.0) == 0.0 and a.idle(0.0) == math.inf
    a.add(0.0)
    assert a.rate(0.0) == pytest.approx(1 / 60)  # one arrival is not an infinite rate
    for t in (100.0, 200.0, 300.0):
        a.add(t)
    assert a.rate(300.0) == pytest.approx(4 / 300) and a.idle(400.0) == 100.0
    assert a.rate(850.0) == pytest.approx(1 / 600)  # the first three fell out
    assert a.rate(2000.0) == 0.0


def test_the_zipf_exponent_is_recovered_from_popularity_counts() -> None:
    for s in (0.8, 1.2, 1.8):
        weights = [i**-s for i in range(1, 201)]
        rng = random.Random(3)
        draws = rng.choices(range(200), weights=weights, k=20_000)
        counts = [draws.count(i) for i in range(200)]
        fitted = zipf_fit(counts)
        assert fitted is not None and abs(fitted - s) < 0.1, (s, fitted)
    assert zipf_fit([5]) is None and zipf_fit([]) is None
    assert zipf_fit([3, 3, 3, 3]) == 0.0  # no skew


def test_measured_gaps_decide_bursty_and_periodic_traffic() -> None:
    # bursts every 15 minutes, three requests each: the hour tier rides through the gaps
    a = ArrivalRate.empty(horizon_s=3600, floor_s=60)
    for burst in range(4):
        for k in range(3):
            a.add(burst * 900.0 + k * 10)
    now = 2800.0
    assert a.miss(300, now) == pytest.approx(3 / 11) and a.miss(3600, now) == 0.0
    v = decide(a.rate(now), ANTHROPIC, 0.0, a.idle(now), 3600, lambda t: a.miss(t, now))
    assert (v.decision, v.ttl_s) == (Decision.RIDE, 3600)
    # every gap just past a 5-minute implicit cache: heartbeats cost less than misses
    implicit = Economics(0.5, (TtlOption(300, 1.0),), writes_billed=False)
    b = ArrivalRate.empty(horizon_s=3600, floor_s=60)
    for t in (0.0, 330.0, 660.0, 990.0):
        b.add(t)
    v = decide(b.rate(1240), implicit, 0.0, b.idle(1240), 3600, lambda t: b.miss(t, 1240))
    assert v.decision is Decision.HEARTBEAT
    # seen once: no reuse shown, nothing spent, the cheaper write
    once = decide(1 / 60, ANTHROPIC, miss=lambda t: 1.0, reused=False)
    assert (once.decision, once.ttl_s) == (Decision.LAZY, 300)
    assert ArrivalRate.empty(60, 60).miss(300, 0.0) == 1.0
