"""The batch workload at a tiny scale, in process on the emulator: the same workload from
the same seed; with anchors that expire between their units in arrival order, the DAG
order bills less than arrival order, and the batch API bills half of what it read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.batch_workload import cost, main, workload


def test_the_workload_is_the_same_from_the_same_seed() -> None:
    a = workload(50, 5, 1.0, seed=7)
    assert a == workload(50, 5, 1.0, seed=7)
    assert a != workload(50, 5, 1.0, seed=8)
    texts, which, own = a
    assert len(texts) == 5 and len(which) == len(own) == 50
    assert all(1000 * 4 <= len(t) <= 4000 * 4 + 64 for t in texts)  # 4 bytes a token


def test_cost_prices_each_class() -> None:
    bill = {"uncached": 100, "read": 1000, "write": 200, "write_long": 10}
    assert cost("anthropic", bill) == pytest.approx(100 + 100 + 250 + 20)
    assert cost("openai", bill, 0.5) == pytest.approx(0.5 * (100 + 500 + 200 + 10))


def test_dag_order_beats_arrival_when_anchors_expire(tmp_path: Path) -> None:
    out = tmp_path / "w.json"
    # 5 requests a minute: 12 s apart, so 100 units take 20 minutes and an anchor's
    # units far apart in arrival order find it expired
    argv = ["--units", "100", "--anchors", "12", "--s", "1.0", "--rpm", "5", "--tpm", "1e9"]
    assert main([*argv, "--out", str(out)]) == 0
    [r] = json.loads(out.read_text())["results"]
    for p in ("anthropic", "openai"):
        c = r["providers"][p]["cost"]
        assert c["dag"] < c["arrival"], (p, c)
        assert 0 < c["batch_api"] < c["arrival"]
    assert 0 < r["top7_coverage"] <= 1 and 0 < r["top7_coverage_zipf"] <= 1
