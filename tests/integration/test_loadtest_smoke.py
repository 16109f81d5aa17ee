"""A short smoke run of every load-test workload (locust, headless) against the test gateway."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import KEY_A, Gateway

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def run_loadtest(gateway: Gateway, demo_model: Path, out: Path, *extra: str) -> None:
    """``python -m loadtests.run --small`` against the session's gateway; fails with its
    stderr."""
    cmd = [
        sys.executable,
        "-m",
        "loadtests.run",
        "--host",
        gateway.base_url,
        "--api-key",
        KEY_A,
        "--small",
        "--users",
        "2",
        "--duration",
        "60",
        "--out",
        str(out),
        "--tokenizer",
        str(demo_model),
        *extra,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    print("\n" + done.stdout)


def test_every_workload_reports_and_hits_only_where_prefixes_are_shared(
    gateway: Gateway, tmp_path: Path, demo_model: Path
) -> None:
    out = tmp_path / "report"
    run_loadtest(gateway, demo_model, out)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"shared_prefix", "multi_turn", "long_document_qa", "zero_reuse"}
    for name, s in summary.items():
        assert s["errors"] == 0, name
        assert s["requests"] == len((out / name / "raw.csv").read_text().splitlines()) - 1
        assert s["ttft_ms"]["p50"] is not None and s["ttft_ms"]["p99"] >= s["ttft_ms"]["p50"]
        assert s["requests_per_s"] > 0
        # the gateway's counters over the run agree with the per-request rows
        assert s["counters"]["gateway_cached_tokens"] == s["cached_tokens"]
        assert s["counters"]["gateway_prompt_tokens"] == s["prompt_tokens"]
        assert (out / name / "locust.html").exists()
        stats = (out / name / "locust_stats.csv").read_text().splitlines()
        ttft = next(r for r in stats if r.startswith("SSE,ttft,"))
        assert int(ttft.split(",")[2]) == s["requests"]  # locust's own count of the run
        for plot in ("ttft_hits_vs_misses.png", "hit_rate_over_time.png"):
            assert (out / name / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", plot
    assert summary["shared_prefix"]["requests"] == 8 and summary["multi_turn"]["requests"] == 6
    for name in ("shared_prefix", "multi_turn", "long_document_qa"):
        assert summary[name]["hit_rate"] > 0.3, name
    assert summary["zero_reuse"]["hit_rate"] == 0.0
    assert summary["zero_reuse"]["counters"]["engine_prefix_cache_hits"] == 0


def test_routing_comparison_runs_every_arm(
    gateway: Gateway, tmp_path: Path, demo_model: Path
) -> None:
    out = tmp_path / "report"
    run_loadtest(gateway, demo_model, out, "--workloads", "zero_reuse", "--compare-routing")
    routing = json.loads((out / "routing.json").read_text())
    assert routing["replicas"] == 2
    assert set(routing["arms"]) == {"kv", "round_robin", "least_loaded", "oracle"}
    for arm, s in routing["arms"].items():
        assert s["requests"] == 8 and s["errors"] == 0, arm
        assert s["hit_rate"] > 0, arm  # the groups share their system prompts
    # the oracle placed every group on its own replica: group g on replica g mod 2
    rows = (out / "shared_prefix-oracle" / "raw.csv").read_text().splitlines()[1:]
    placed = {(r.split(",")[1], r.split(",")[10]) for r in rows}
    assert placed <= {("group-0", "replica-0"), ("group-1", "replica-1")}


def test_grpc_user_measures_the_same_workload(
    gateway: Gateway, tmp_path: Path, demo_model: Path
) -> None:
    out = tmp_path / "report"
    run_loadtest(
        gateway,
        demo_model,
        out,
        "--workloads",
        "shared_prefix",
        "--protocols",
        "grpc",
        "--grpc-target",
        gateway.grpc_target,
    )
    s = json.loads((out / "summary.json").read_text())["shared_prefix-grpc"]
    assert s["protocol"] == "grpc"
    assert s["requests"] == 8 and s["errors"] == 0
    assert s["hit_rate"] > 0.3
    assert s["counters"]["gateway_cached_tokens"] == s["cached_tokens"]
    stats = (out / "shared_prefix-grpc" / "locust_stats.csv").read_text()
    assert "gRPC,ttft" in stats and "gRPC,total" in stats  # events fired by the interceptor
    rows = (out / "shared_prefix-grpc" / "raw.csv").read_text().splitlines()[1:]
    assert {r.split(",")[9] for r in rows} == {"local"}
