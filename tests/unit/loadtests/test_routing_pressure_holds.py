"""routing_pressure's hold cost: an arm's predictions and holds from the gateway's
``/metrics`` before and after it, the real exposition as input."""

from __future__ import annotations

from prometheus_client import generate_latest

from gateway.core.metrics import Metrics
from loadtests.routing_pressure import hold_cost, series, table


def test_an_arms_results_holds_and_hold_time() -> None:
    m = Metrics()
    m.prediction_results.labels("exact", "").inc(5)  # before the arm
    before = series(generate_latest(m.registry).decode())
    m.prediction_results.labels("exact", "").inc(97)
    m.prediction_results.labels("approximate", "hold_budget").inc(2)
    m.prediction_results.labels("missed", "evicted").inc(1)
    for _ in range(98):
        m.kv_holds.labels("replica-0", "held").inc()
        m.kv_hold_blocks.labels("replica-0").inc(12)
        m.kv_hold_seconds.observe(0.03)
    m.kv_holds.labels("replica-1", "budget").inc(2)
    m.prefill_waits.labels("joined").inc(3)
    m.kv_hold_seconds.observe(2.0)
    m.kv_hold_seconds.observe(3.0)
    out = hold_cost(before, series(generate_latest(m.registry).decode()))
    assert out["results"] == {"exact": 97, "approximate:hold_budget": 2, "missed:evicted": 1}
    assert out["holds"] == {"held": 98, "budget": 2}
    assert out["prefill_waits"] == {"joined": 3}
    assert out["blocks_held"] == 98 * 12 and out["blocks_per_hold"] == 12
    assert out["hold_p99_s_at_most"] == 2.5  # 99 of 100 within the 2.5 s bucket
    assert abs(out["hold_mean_s"] - (98 * 0.03 + 5) / 100) < 1e-9
    row = {
        "arm": "kv",
        "requests": 100,
        "errors": 0,
        "hit_rate": 0.8,
        "ttft_ms": {"p50": 70, "p90": 150},
        "prediction": {"exact_share": 0.99, "mean_abs_error_tokens": 1.3},
        "holds": out,
    }
    # said approximate, blocks a hold, mean hold ms, p99 bound
    assert table([row]).splitlines()[1].split()[-4:] == ["2", "12.0", "79", "<=2.5"]
