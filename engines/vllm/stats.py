"""Engine-core truth, as vLLM's scheduler reports it with every output batch.

vLLM hands ``SchedulerStats`` to stat loggers in the frontend process after
each engine step.  :class:`CoreStats` keeps the latest gauges and running
totals so the gateway can export them (and tests can see what the engine
core itself holds, not only what the frontend believes).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engines.base import EngineStats


class CoreStats:
    def __init__(self) -> None:
        self.snapshot = EngineStats()

    def factory(self) -> Any:
        """A vLLM ``StatLoggerFactory`` whose loggers write into this object."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        sink = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(
                self,
                scheduler_stats: Any,
                iteration_stats: Any,
                mm_cache_stats: Any = None,
                engine_idx: int = 0,
            ) -> None:
                if scheduler_stats is not None:
                    sink.record(scheduler_stats)

            def log_engine_initialized(self) -> None:
                pass

        return _Logger

    def record(self, stats: Any) -> None:
        s = self.snapshot
        pc = stats.prefix_cache_stats
        self.snapshot = replace(
            s,
            core_running_requests=int(stats.num_running_reqs),
            core_waiting_requests=int(stats.num_waiting_reqs),
            kv_cache_usage=float(stats.kv_cache_usage),
            prefix_cache_queries=s.prefix_cache_queries + (int(pc.queries) if pc else 0),
            prefix_cache_hits=s.prefix_cache_hits + (int(pc.hits) if pc else 0),
        )
