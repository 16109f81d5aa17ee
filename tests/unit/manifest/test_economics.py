"""The design note's numbers, reproduced (shared/seeds/001, §5 and §10)."""

from __future__ import annotations

import pytest

from manifest.economics import (
    chain_horizon,
    dedicated_warm_break_even,
    pin_pays,
    rpm_tpm_crossover,
    warm_set_size,
    zipf_coverage,
    zipf_skew_for_coverage,
)


def test_seven_anchors_covering_85_percent_need_skew_1_74() -> None:
    s = zipf_skew_for_coverage(7, 1000, 0.85)
    assert round(s, 2) == 1.74
    assert zipf_coverage(7, 1000, s) == pytest.approx(0.85, abs=1e-9)
    # ≈ V-independent over 10^3 .. 5·10^3
    assert round(zipf_skew_for_coverage(7, 5000, 0.85), 1) == 1.7


def test_top_seven_at_classic_zipf() -> None:
    assert round(zipf_coverage(7, 1000, 1.0), 3) == 0.346
    assert round(zipf_coverage(7, 1000, 0.8), 3) == 0.197


def test_chain_horizons() -> None:
    assert [chain_horizon(m, 10) for m in (1024, 2048, 4096)] == [103, 205, 410]


def test_rate_limit_crossover_and_warm_sets() -> None:
    assert rpm_tpm_crossover(2000, 200_000) == 100
    assert warm_set_size(2000, 200_000, 4096, 5) == pytest.approx(244.1, abs=0.1)
    assert warm_set_size(2000, 200_000, 16384, 5) == pytest.approx(61.0, abs=0.1)
    assert warm_set_size(2000, 200_000, 65536, 5) == pytest.approx(15.3, abs=0.1)


def test_dedicated_warm_break_even() -> None:
    assert dedicated_warm_break_even(1.25, 0.1) == 2  # Anthropic 5-minute TTL
    assert dedicated_warm_break_even(2.0, 0.1) == 3  # Anthropic 1-hour TTL


def test_pin_rule() -> None:
    # ln((1.25 + 0 + 1) / 1) ≈ 0.81: about one request per TTL tips it
    assert pin_pays(0.9, 1.25, latency_value=1, shadow_price=0)
    assert not pin_pays(0.7, 1.25, latency_value=1, shadow_price=0)
    assert not pin_pays(100, 1.25, latency_value=0, shadow_price=0)


@pytest.mark.parametrize(
    "call",
    [
        lambda: zipf_coverage(5, 3, 1.0),
        lambda: zipf_skew_for_coverage(7, 1000, 1.5),
        lambda: zipf_skew_for_coverage(1, 2, 0.9999999999),
        lambda: dedicated_warm_break_even(1.25, 1.0),
        lambda: chain_horizon(1024, 0),
        lambda: warm_set_size(1, 1, 0, 5),
        lambda: rpm_tpm_crossover(0, 1),
    ],
)
def test_invalid_inputs_raise(call: object) -> None:
    assert callable(call)
    with pytest.raises(ValueError):
        call()
