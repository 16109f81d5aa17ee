"""The load-test report's tables say what each row ran."""

from __future__ import annotations

from loadtests.run import table


def _result(workload: str, protocol: str = "http") -> dict[str, object]:
    ttft = {"p50": 12.0, "p90": 30.0, "p99": None}
    return {
        "workload": workload,
        "protocol": protocol,
        "requests": 10,
        "errors": 0,
        "hit_rate": 0.5,
        "ttft_ms": ttft,
        "requests_per_s": 2.0,
    }


def test_each_row_names_its_workload_under_a_title() -> None:
    out = table(
        {"kv": _result("shared_prefix"), "round_robin": _result("shared_prefix", "grpc")},
        "routing comparison: shared_prefix on 2 replicas, per arm",
        row="arm",
    ).splitlines()
    assert out[0].startswith("routing comparison")
    assert out[1].split()[:3] == ["arm", "workload", "proto"]
    assert out[2].split()[:3] == ["kv", "shared_prefix", "http"]
    assert out[3].split()[:3] == ["round_robin", "shared_prefix", "grpc"]
    assert out[3].split()[-3:] == ["30", "-", "2.00"]
