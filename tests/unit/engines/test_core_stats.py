"""The engine client's stat logger (engines/vllm/stats.py): the scheduler's stats reach
CoreStats, and vLLM's own Prometheus logger is not added beside it (its metrics were
never exported, and it cost the frontend CPU every engine step)."""

from __future__ import annotations

from pathlib import Path

from engines.vllm.stats import CoreStats


def test_core_stats_take_the_place_of_vllms_prometheus_logger(demo_model: Path) -> None:
    from prometheus_client import REGISTRY
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.metrics.loggers import StatLoggerManager
    from vllm.v1.metrics.stats import IterationStats, PrefixCacheStats, SchedulerStats

    config = VllmConfig(model_config=ModelConfig(model=str(demo_model), max_model_len=2048))
    stats = CoreStats()
    before = set(REGISTRY._names_to_collectors)
    manager = StatLoggerManager(
        vllm_config=config,
        engine_idxs=[0],
        custom_stat_loggers=[stats.factory()],
        enable_default_loggers=False,
    )
    # ours alone: vLLM adds its Prometheus logger to a manager that has none
    assert [type(lg).__module__ for lg in manager.stat_loggers] == ["engines.vllm.stats"]
    made = set(REGISTRY._names_to_collectors) - before
    assert not [n for n in made if n.startswith("vllm:")]  # no vLLM metric made

    step = SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.25)
    step.prefix_cache_stats = PrefixCacheStats(requests=1, queries=48, hits=32)
    manager.record(step, IterationStats(), engine_idx=0)
    manager.record(step, None, engine_idx=0)
    manager.record(None, IterationStats(), engine_idx=0)  # outputs without scheduler stats
    manager.record_admission_rejection("max_num_queued_reqs")
    manager.log()
    got = stats.snapshot
    assert (got.core_running_requests, got.core_waiting_requests) == (3, 2)
    assert got.kv_cache_usage == 0.25
    assert (got.prefix_cache_queries, got.prefix_cache_hits) == (96, 64)
