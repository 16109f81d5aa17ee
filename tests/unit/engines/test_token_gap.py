"""The engine's pace (engines/vllm/stats.py): each step's inter-token gaps, as vLLM's
``IterationStats`` holds them, over the tokens they covered, folded into a moving average
per request (``EngineStats.token_gap_s``); None until a gap is seen."""

from __future__ import annotations

import pytest
from vllm.v1.metrics.stats import IterationStats, SchedulerStats

from engines.vllm.stats import GAP_WEIGHT, CoreStats


def _step(*gaps: float, tokens: int = 0, first: int = 0) -> IterationStats:
    """A step's stats: one gap per output of a running request, ``tokens`` made in all
    (``first`` of them first tokens, which have no gap)."""
    it = IterationStats()
    it.inter_token_latencies_iter.extend(gaps)
    it.time_to_first_tokens_iter.extend([0.1] * first)
    it.num_generation_tokens = tokens
    return it


def test_the_gap_is_a_moving_average_of_each_steps_mean() -> None:
    stats = CoreStats()
    assert stats.snapshot.token_gap_s is None
    stats.record(None, IterationStats())  # a step of first tokens only: no gap yet
    assert stats.snapshot.token_gap_s is None
    stats.record(None, _step(0.004, 0.006))  # the first step's mean
    assert stats.snapshot.token_gap_s == pytest.approx(0.005)
    stats.record(SchedulerStats(num_running_reqs=2), _step(0.015, 0.015))
    assert stats.snapshot.token_gap_s == pytest.approx(0.005 + GAP_WEIGHT * 0.010)
    assert stats.snapshot.core_running_requests == 2
    stats.record(SchedulerStats(num_running_reqs=1), None)  # kept without a new gap
    assert stats.snapshot.token_gap_s == pytest.approx(0.005 + GAP_WEIGHT * 0.010)
    for _ in range(100):
        stats.record(None, _step(0.030))
    assert stats.snapshot.token_gap_s == pytest.approx(0.030, rel=1e-3)


def test_an_output_coalesced_in_the_core_counts_each_of_its_tokens() -> None:
    """Outputs held back in the core (engines/vllm/core_coalesce.py) reach the frontend
    carrying several tokens each: their gap is over those tokens, not one."""
    stats = CoreStats()
    # two running requests' outputs of 4 tokens each, 24 ms after their last, beside a
    # new request's first token
    stats.record(None, _step(0.024, 0.024, tokens=9, first=1))
    assert stats.snapshot.token_gap_s == pytest.approx(0.006)
    stats.record(None, _step(0.006, 0.006, tokens=3, first=1))  # an output a token again
    assert stats.snapshot.token_gap_s == pytest.approx(0.006)


def test_vllms_stat_logger_hands_the_gaps_on(demo_model: object) -> None:
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.metrics.loggers import StatLoggerManager

    config = VllmConfig(model_config=ModelConfig(model=str(demo_model), max_model_len=2048))
    stats = CoreStats()
    manager = StatLoggerManager(
        vllm_config=config,
        engine_idxs=[0],
        custom_stat_loggers=[stats.factory()],
        enable_default_loggers=False,
    )
    manager.record(None, _step(0.005, 0.005, 0.005), engine_idx=0)
    assert stats.snapshot.token_gap_s == pytest.approx(0.005)
