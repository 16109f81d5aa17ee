"""Labelled metrics keep their children: the same label values give the same child (one
dict lookup a call, not prometheus_client's conversion and lock), and what they count is
scraped as before, one series per label set."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client.metrics import MetricWrapperBase

from gateway.core.metrics import Metrics


def test_a_kept_child_skips_prometheus_clients_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[object, ...]] = []
    library = MetricWrapperBase.labels

    def counted(self: Any, *values: object, **kw: object) -> Any:
        calls.append(values)
        return library(self, *values, **kw)

    monkeypatch.setattr(MetricWrapperBase, "labels", counted)
    metrics = Metrics()
    for _ in range(3):
        metrics.kv_holds.labels("replica-0", "held").inc()
        metrics.queue_time.labels("demo", "replica-0").observe(0.01)
    assert calls == [("replica-0", "held"), ("demo", "replica-0")]


def test_the_same_label_values_give_the_same_child_and_one_series() -> None:
    metrics = Metrics()
    first = metrics.ttft.labels("chat", "demo", "local", "replica-0")
    assert metrics.ttft.labels("chat", "demo", "local", "replica-0") is first
    assert metrics.ttft.labels("chat", "demo", "local", "replica-1") is not first
    first.observe(0.2)
    metrics.ttft.labels("chat", "demo", "local", "replica-0").observe(0.4)
    metrics.requests.labels("/v1/chat/completions", 200).inc()
    metrics.requests.labels("/v1/chat/completions", "200").inc()  # str() of the value
    text = metrics.render().decode()
    assert (
        'vcache_ttft_seconds_count{endpoint="chat",model="demo",replica="replica-0",'
        'target="local"} 2.0' in text
    )
    assert 'replica="replica-1"' in text  # a child made is scraped, at zero
    assert 'vcache_requests_total{route="/v1/chat/completions",status="200"} 2.0' in text
