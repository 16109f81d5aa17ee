"""Prometheus metrics, one registry per app (no process-global state)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engines.base import EngineStats

_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _EngineCollector(Collector):
    """Reads the engine's stats at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        gauges = (
            (
                "unfinished_requests",
                "Requests the gateway's engine client still holds",
                s.unfinished_requests,
            ),
            (
                "core_running_requests",
                "Running requests, as the engine core last reported",
                s.core_running_requests,
            ),
            (
                "core_waiting_requests",
                "Waiting requests, as the engine core last reported",
                s.core_waiting_requests,
            ),
            ("kv_cache_usage", "Share of KV cache blocks in use (0..1)", s.kv_cache_usage),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"vcache_engine_{name}", doc, value=float(value))
        yield CounterMetricFamily(
            "vcache_engine_prefix_cache_queries",
            "Prompt tokens the engine looked up in its prefix cache",
            value=float(s.prefix_cache_queries),
        )
        yield CounterMetricFamily(
            "vcache_engine_prefix_cache_hits",
            "Prompt tokens the engine found in its prefix cache",
            value=float(s.prefix_cache_hits),
        )


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "vcache_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.errors = Counter("vcache_errors", "Errors returned, by type", ["type"], registry=r)
        self.ttft = Histogram(
            "vcache_ttft_seconds",
            "Time from request arrival to the first generated token",
            ["endpoint"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.request_time = Histogram(
            "vcache_request_duration_seconds",
            "Time from request arrival to the response's last byte, by route",
            ["route"],
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "vcache_inter_token_latency_seconds",
            "Time between consecutive outputs of one local request, by replica",
            ["replica"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.aborted = Counter(
            "vcache_requests_aborted",
            "Requests whose client went away before the engine finished",
            ["endpoint"],
            registry=r,
        )
        self.predictions = Counter(
            "vcache_cached_token_predictions",
            "Predicted cached tokens compared with the engine's num_cached_tokens",
            ["outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "vcache_prompt_tokens", "Prompt tokens sent to engines", registry=r
        )
        self.cached_tokens = Counter(
            "vcache_cached_tokens",
            "Prompt tokens served from the engine's prefix cache",
            registry=r,
        )
        self.completion_tokens = Counter("vcache_completion_tokens", "Tokens generated", registry=r)
        self.provider_requests = Counter(
            "vcache_provider_requests",
            "Calls to hosted providers",
            ["target", "outcome"],
            registry=r,
        )
        self.provider_tokens = Counter(
            "vcache_provider_tokens",
            "Provider prompt tokens: prompt, cached (read), written, credited (verified savings)",
            ["target", "kind"],
            registry=r,
        )
        self.provider_false_warm = Counter(
            "vcache_provider_false_warm",
            "Prefixes believed warm that the provider's telemetry read cold",
            ["target"],
            registry=r,
        )
        self.routing_decisions = Counter(
            "vcache_routing_decisions",
            "Local routing decisions, by policy and the reason for the replica it chose",
            ["policy", "reason"],
            registry=r,
        )
        self.fallbacks = Counter(
            "vcache_fallbacks",
            "Requests moved to the next target of a model alias, by the target that failed",
            ["target", "reason"],
            registry=r,
        )

    def count_routing(self, policy: str, reason: str) -> None:
        self.routing_decisions.labels(policy, reason).inc()

    def watch_engine(self, stats: Callable[[], EngineStats]) -> None:
        self.registry.register(_EngineCollector(stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
