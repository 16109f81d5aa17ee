"""The load tests' reading of a Prometheus histogram between two scrapes."""

from __future__ import annotations

import pytest

from loadtests.report import histogram, histogram_quantile, phases_table, ttft_phases

N = "vcache_ttft_phase_seconds"


def _scrape(counts: list[float], s: float, extra: float = 0.0) -> dict[str, float]:
    """One series with buckets 0.1, 0.2, 0.4, +Inf, and another series ``extra``."""
    out = {}
    for le, c in zip(("0.1", "0.2", "0.4", "+Inf"), counts, strict=True):
        out[f'{N}_bucket{{phase="gate",priority="interactive",le="{le}"}}'] = c
        out[f'{N}_bucket{{phase="gate",priority="batch",le="{le}"}}'] = extra
    out[f'{N}_sum{{phase="gate",priority="interactive"}}'] = s
    out[f'{N}_count{{phase="gate",priority="interactive"}}'] = counts[-1]
    return out


def test_the_delta_of_one_series_and_its_quantiles() -> None:
    before = _scrape([1, 1, 1, 1], 0.05, extra=3)
    after = _scrape([3, 7, 11, 11], 2.05, extra=9)  # 2 in ≤0.1, 4 in ≤0.2, 4 in ≤0.4
    buckets, total, count = histogram(before, after, N, 'priority="interactive"')
    assert buckets == [(0.1, 2.0), (0.2, 6.0), (0.4, 10.0), (float("inf"), 10.0)]
    assert total == pytest.approx(2.0)
    assert count == 10.0
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.175)  # rank 5: 3/4 into (0.1, 0.2]
    assert histogram_quantile(buckets, 0.9) == pytest.approx(0.35)  # rank 9: 3/4 into (0.2, 0.4]
    assert histogram_quantile(buckets, 0.1) == pytest.approx(0.05)


def test_past_the_last_bound_and_empty() -> None:
    buckets = [(0.1, 1.0), (float("inf"), 4.0)]
    assert histogram_quantile(buckets, 0.9) == 0.1
    assert histogram_quantile([], 0.9) is None
    assert histogram_quantile([(0.1, 0.0), (float("inf"), 0.0)], 0.5) is None


def test_a_runs_phases_and_their_table() -> None:
    before = _scrape([1, 1, 1, 1], 0.05)
    after = _scrape([3, 7, 11, 11], 2.05)
    phases = ttft_phases(before, after, "interactive")
    assert phases["gate"] == {
        "mean_ms": pytest.approx(200.0),
        "p90_ms": pytest.approx(350.0),
        "count": 10.0,
    }
    assert phases["prefill"]["mean_ms"] is None  # not in the scrape
    table = phases_table([{"arm": "alone", "phases": phases}]).splitlines()
    assert table[0].split() == ["run", "prepare", "gate", "submit", "queue", "prefill", "return"]
    assert table[1].split() == ["alone", "-", "200.0", "/", "350", "-", "-", "-", "-"]
