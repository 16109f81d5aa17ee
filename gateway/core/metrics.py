"""Prometheus metrics, one registry per app (no process-global state).

Under ``--workers`` the parent gives every worker one ``PROMETHEUS_MULTIPROC_DIR``
(prometheus_client's multiprocess mode: each process writes its counters and
histograms to files there), and a scrape, whichever worker takes it, sums every
worker's, the dead ones' included (counters stay monotonic across a restart).
The engine gauges read at scrape time are the scraping worker's view."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Self

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

from engines.base import EngineStats

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # set by the parent of --workers
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_QUEUE_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5, 30)
_PHASE_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1,
    1.5,
    2.5,
    5,
    30,
)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _KeptChildren(MetricWrapperBase):
    """A labelled metric whose children are kept by their label values: prometheus_client's
    ``labels`` converts each value to a string, checks their count and takes a lock at every
    call (about twenty calls a local request); a kept child is one dict lookup.  Label
    values are given by position."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kept: dict[tuple[object, ...], Self] = {}

    def labels(self, *labelvalues: object) -> Self:  # type: ignore[override]
        child = self._kept.get(labelvalues)
        if child is None:
            child = self._kept[labelvalues] = super().labels(*labelvalues)
        return child


class Counter(_KeptChildren, prometheus_client.Counter):
    pass


class Histogram(_KeptChildren, prometheus_client.Histogram):
    pass


class _EngineCollector(Collector):
    """Reads each replica's engine stats at scrape time (label ``replica``)."""

    _GAUGES = (  # (EngineStats field, metric name after vcache_engine_, help)
        (
            "unfinished_requests",
            "unfinished_requests",
            "Requests the gateway's engine client still holds",
        ),
        (
            "core_running_requests",
            "core_running_requests",
            "Running requests, as the engine core last reported",
        ),
        (
            "core_waiting_requests",
            "core_waiting_requests",
            "Waiting requests, as the engine core last reported",
        ),
        ("kv_cache_usage", "kv_cache_usage_ratio", "Share of KV cache blocks in use (0..1)"),
    )
    _COUNTERS = (
        ("prefix_cache_queries", "Prompt tokens the engine looked up in its prefix cache"),
        ("prefix_cache_hits", "Prompt tokens the engine found in its prefix cache"),
        (
            "image_expansion_mismatches",
            "Image requests a remote replica expanded to other token ids than the gateway's",
        ),
    )

    def __init__(self, stats: Callable[[], Mapping[str, EngineStats]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        per_replica = self._stats()
        for field, name, doc in self._GAUGES:
            g = GaugeMetricFamily(f"vcache_engine_{name}", doc, labels=["replica"])
            for replica, s in per_replica.items():
                g.add_metric([replica], float(getattr(s, field)))
            yield g
        for field, doc in self._COUNTERS:
            c = CounterMetricFamily(f"vcache_engine_{field}", doc, labels=["replica"])
            for replica, s in per_replica.items():
                c.add_metric([replica], float(getattr(s, field)))
            yield c


class Metrics:
    def __init__(self, multiprocess_dir: str | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._multiprocess_dir = multiprocess_dir
        self._scraped: list[Collector] = []  # read at scrape time (multiprocess: added)
        r = self.registry
        self.requests = Counter(
            "vcache_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.errors = Counter("vcache_errors", "Errors returned, by type", ["type"], registry=r)
        self.ttft = Histogram(
            "vcache_ttft_seconds",
            "Time from request arrival to the first generated token",
            ["endpoint", "model", "target", "replica"],
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
            "Time between consecutive outputs of one request whose tokens are streamed "
            "(an answer sent whole has its outputs coalesced by the engine)",
            ["model", "target", "replica"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.ttft_phase = Histogram(
            "vcache_ttft_phase_seconds",
            "A local request's time to first token by phase: prepare, gate, submit, queue, "
            "prefill, return (gateway/local/ttft.py); they add up to vcache_ttft_seconds",
            ["phase", "priority"],
            buckets=_PHASE_BUCKETS,
            registry=r,
        )
        self.loop_lag = Histogram(
            "vcache_event_loop_lag_seconds",
            "How long a callback made ready on the gateway's event loop waited to run "
            "(gateway/core/loop_watch.py): every request in flight waits as long",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.gc_pause = Histogram(
            "vcache_gc_pause_seconds",
            "The gateway's garbage collections, by generation: the loop runs nothing meanwhile",
            ["generation"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "vcache_queue_time_seconds",
            "Time a local request waited in the engine's queue before it was scheduled",
            ["model", "replica"],
            buckets=_QUEUE_BUCKETS,
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
            "vcache_prompt_tokens",
            "Prompt tokens sent to local engines",
            ["model", "replica"],
            registry=r,
        )
        self.cached_tokens = Counter(
            "vcache_cached_tokens",
            "Prompt tokens served from a local engine's prefix cache",
            ["model", "replica"],
            registry=r,
        )
        self.completion_tokens = Counter(
            "vcache_completion_tokens",
            "Tokens generated by local engines",
            ["model", "replica"],
            registry=r,
        )
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
        self.alias_routes = Counter(
            "vcache_alias_routes",
            "Requests on a model alias with several targets, by the target that went first "
            "and why (cost: cheaper than the alias's first; order: the alias's first)",
            ["target", "by"],
            registry=r,
        )
        self.fallbacks = Counter(
            "vcache_fallbacks",
            "Requests moved to the next target of a model alias, by the target that failed",
            ["target", "reason"],
            registry=r,
        )
        self.shed = Counter(
            "vcache_requests_shed",
            "Requests refused by admission (the queue full for their priority)",
            ["priority"],
            registry=r,
        )
        self.sessions = Counter(
            "vcache_session_requests",
            "Requests appended to the session log, by how they found their session: named "
            "(a header, an agent's session id, a previous response), found (by prefix "
            "digests), new",
            ["kind"],
            registry=r,
        )
        self.retention = Counter(
            "vcache_session_retention",
            "Turns of agent sessions that ended, by what was done with their KV: leased "
            "until the next turn, refused (pin budget), released, none, short, off; and "
            "preempted: a lease past its expected pause released for another's; yielded: a "
            "paused session's lease released for a live request's KV room",
            ["outcome"],
            registry=r,
        )
        self.prefill_waits = Counter(
            "vcache_prefill_waits",
            "Requests that waited for a running prefill of their prefix on their replica "
            "(joined: it stored the blocks; timeout: the wait ended first)",
            ["outcome"],
            registry=r,
        )
        self.refreshed_blocks = Counter(
            "vcache_kv_refreshed_blocks",
            "Predicted cached blocks moved to the end of their replica's eviction order "
            "before the request ran (touched; missing: evicted before the touch came)",
            ["replica", "result"],
            registry=r,
        )
        self.prediction_results = Counter(
            "vcache_prediction_results",
            "Local predictions of cached tokens against the engine's report: exact (held "
            "or cold, and right), approximate (cause: hold_budget, hold_reserve, hold_failed, "
            "hold_unanswered, no_hold, prefill_in_flight), missed (said exact, wrong; cause: "
            "evicted, stored_since)",
            ["result", "cause"],
            registry=r,
        )
        self.kv_holds = Counter(
            "vcache_kv_holds",
            "Holds asked of a replica's engine for a routed request's predicted blocks "
            "(held; none: nothing resident; budget, reserve: refused; failed)",
            ["replica", "outcome"],
            registry=r,
        )
        self.kv_hold_blocks = Counter(
            "vcache_kv_hold_blocks",
            "Blocks held for routed requests until their first token (sum over holds)",
            ["replica"],
            registry=r,
        )
        self.kv_hold_seconds = Histogram(
            "vcache_kv_hold_seconds",
            "How long a hold awaited in routing kept its blocks (routing to first token or "
            "end; a hold carried in its request is the engine core's, queue to schedule)",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self.prefill_stops = Counter(
            "vcache_prefill_stops",
            "Prompts of a lower priority stopped in their prefill for a higher one's on their "
            "replica, then started again (engine.preempt_prefills)",
            ["replica"],
            registry=r,
        )
        self.fair_waits = Counter(
            "vcache_fair_queue_waits",
            "Requests that waited for a slot in their replica's engine (engine.max_num_seqs)",
            ["replica"],
            registry=r,
        )
        self.rate_limited = Counter(
            "vcache_rate_limited",
            "Requests refused by a key's limits, by tenant and key",
            ["tenant", "key"],
            registry=r,
        )
        self.batch_items = Counter(
            "vcache_batch_items",
            "Batch items the runner settled, by endpoint and state (completed, failed; "
            "retried: refused for load and sent again; dropped: cancelled while waiting)",
            ["endpoint", "state"],
            registry=r,
        )
        self.batch_pins = Counter(
            "vcache_batch_pins",
            "Batch anchors pinned on the local replicas while their siblings run (taken, "
            "skipped: nothing to pin, released)",
            ["outcome"],
            registry=r,
        )
        self.batch_recall = Counter(
            "vcache_batch_recall",
            "Recall decisions on a batch's settled parents (replay, fresh)",
            ["decision"],
            registry=r,
        )
        self.batch_recall_tokens = Counter(
            "vcache_batch_recall_tokens",
            "Recall decisions' predicted cost (replay_cost: P*r) and saving (k*u*(1-r)), and "
            "once their batch's items ran the measured ones (replay_cost_measured: the replay's "
            "uncached input plus its cached at r; saving_measured: the children's cached tokens "
            "at 1-r), in input-token equivalents",
            ["decision", "kind"],
            registry=r,
        )

    def count_routing(self, policy: str, reason: str) -> None:
        self.routing_decisions.labels(policy, reason).inc()

    def watch_engines(self, stats: Callable[[], Mapping[str, EngineStats]]) -> None:
        collector = _EngineCollector(stats)
        self.registry.register(collector)
        self._scraped.append(collector)

    def render(self) -> bytes:
        if self._multiprocess_dir is None:
            return generate_latest(self.registry)
        from prometheus_client.multiprocess import MultiProcessCollector

        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=self._multiprocess_dir)  # type: ignore[no-untyped-call]
        for c in self._scraped:
            merged.register(c)
        return generate_latest(merged)
