"""Each replica's engine stats are read into ``/metrics`` at scrape time."""

from __future__ import annotations

from engines.base import EngineStats
from gateway.core.metrics import Metrics


def test_engine_stats_are_scraped_per_replica() -> None:
    stats = {
        "replica-0": EngineStats(unfinished_requests=2, prefix_cache_hits=384),
        "remote-0": EngineStats(image_expansion_mismatches=3),
    }
    metrics = Metrics()
    metrics.watch_engines(lambda: stats)
    text = metrics.render().decode()
    assert 'vcache_engine_unfinished_requests{replica="replica-0"} 2.0' in text
    assert 'vcache_engine_prefix_cache_hits_total{replica="replica-0"} 384.0' in text
    assert 'vcache_engine_image_expansion_mismatches_total{replica="remote-0"} 3.0' in text
    assert 'vcache_engine_image_expansion_mismatches_total{replica="replica-0"} 0.0' in text
