"""Engine-core truth, as vLLM's scheduler reports it with every output batch.

vLLM hands ``SchedulerStats`` to stat loggers in the frontend process after
each engine step.  :class:`CoreStats` keeps the latest gauges and running
totals so the gateway can export them (and tests can see what the engine
core itself holds, not only what the frontend believes).

Its logger takes the place of vLLM's own Prometheus logger, which vLLM adds to
every ``AsyncLLM`` that has none (``StatLoggerManager``): the gateway exports
its own registry (``gateway/core/metrics.py``), never vLLM's, and vLLM's logger
cost the frontend 17-20 µs an engine step and 13 µs a finished request (36-44
and 32 under ``--workers``, whose multiprocess metrics write every update to a
file) for metrics no one read.

Each step's ``IterationStats`` holds, per output of a running request, the time since
that request's output before (``inter_token_latencies_iter``), and the tokens the
step's outputs carried (``num_generation_tokens``, a request's first token included,
one per ``time_to_first_tokens_iter``).  Their gaps over their tokens (an output
coalesced in the core carries several: engines/vllm/core_coalesce.py), a moving
average over steps, is the engine's pace a token per request now
(``EngineStats.token_gap_s``), by which a streamed answer's outputs are coalesced
(``gateway/local/coalesce.py``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from engines.base import EngineStats

# the weight of a step's mean gap in the moving average: ~10 steps (~50 ms at 5 ms a
# token, ~0.3 s at 30 ms) make the pace; one slow step (a long prefill beside the
# decodes) moves it a tenth of the way
GAP_WEIGHT = 0.1


class CoreStats:
    def __init__(self, gap_weight: float = GAP_WEIGHT) -> None:
        self.snapshot = EngineStats()
        self._gap_weight = gap_weight

    def factory(self) -> Any:
        """A vLLM ``StatLoggerFactory`` whose logger writes into this object, in the
        place of vLLM's Prometheus logger (a subclass of it, so vLLM adds none; it
        builds none of its metrics)."""
        from vllm.v1.metrics.loggers import PrometheusStatLogger

        sink = self

        class _Logger(PrometheusStatLogger):
            def __init__(self, vllm_config: Any, engine_indexes: Any = None) -> None:
                pass  # not vLLM's: no metric is made, none registered

            def record(
                self,
                scheduler_stats: Any,
                iteration_stats: Any,
                mm_cache_stats: Any = None,
                engine_idx: int = 0,
            ) -> None:
                if scheduler_stats is not None or iteration_stats is not None:
                    sink.record(scheduler_stats, iteration_stats)

            def record_admission_rejection(self, reason: str) -> None:
                pass

            def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
                pass

            def log_engine_initialized(self) -> None:
                pass

            def log(self) -> None:
                pass

        return _Logger

    def record(self, stats: Any, iteration: Any = None) -> None:
        """Fold one engine step: the scheduler's ``stats`` (gauges and totals) and the
        step's ``iteration`` stats (its inter-token gaps); either may be None."""
        s = self.snapshot
        gap = s.token_gap_s
        if iteration is not None and (gaps := iteration.inter_token_latencies_iter):
            tokens = iteration.num_generation_tokens - len(iteration.time_to_first_tokens_iter)
            step = sum(gaps) / max(tokens, len(gaps))  # each gap covers one token or more
            gap = step if gap is None else gap + self._gap_weight * (step - gap)
        if stats is None:
            if gap != s.token_gap_s:
                self.snapshot = replace(s, token_gap_s=gap)
            return
        pc = stats.prefix_cache_stats
        self.snapshot = replace(
            s,
            core_running_requests=int(stats.num_running_reqs),
            core_waiting_requests=int(stats.num_waiting_reqs),
            kv_cache_usage=float(stats.kv_cache_usage),
            prefix_cache_queries=s.prefix_cache_queries + (int(pc.queries) if pc else 0),
            prefix_cache_hits=s.prefix_cache_hits + (int(pc.hits) if pc else 0),
            token_gap_s=gap,
        )
