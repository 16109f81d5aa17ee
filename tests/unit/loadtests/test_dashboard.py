"""The static dashboard's arithmetic: rates and histogram quantiles per scrape interval."""

from __future__ import annotations

from loadtests.dashboard import _quantile, series


def _hist(counts: dict[str, float]) -> dict[str, float]:
    return {
        f'vcache_ttft_seconds_bucket{{endpoint="chat",le="{le}"}}': v for le, v in counts.items()
    }


def test_a_quantile_interpolates_inside_its_bucket() -> None:
    before = _hist({"0.1": 0, "0.5": 0, "1.0": 0, "+Inf": 0})
    after = _hist({"0.1": 10, "0.5": 30, "1.0": 40, "+Inf": 40})  # 10 / 20 / 10 in the buckets
    assert _quantile(before, after, "vcache_ttft_seconds", 0.5) == 0.1 + 0.4 * (10 / 20)
    assert _quantile(after, after, "vcache_ttft_seconds", 0.5) is None  # nothing observed


def test_hit_rate_is_cached_over_prompt_tokens_per_interval() -> None:
    samples = [
        (0.0, {"vcache_prompt_tokens_total": 0.0, "vcache_cached_tokens_total": 0.0}),
        (2.0, {"vcache_prompt_tokens_total": 1000.0, "vcache_cached_tokens_total": 250.0}),
        (4.0, {"vcache_prompt_tokens_total": 2000.0, "vcache_cached_tokens_total": 1000.0}),
    ]
    times, panels = series(samples)
    assert times == [2.0, 4.0]
    assert panels["Prefix-cache hit rate"]["hit rate"] == [0.25, 0.75]
    assert panels["Prompt and cached tokens/s"]["prompt"] == [500.0, 500.0]
