"""Each embedded replica's CPU cores on this host: vLLM lists the host's CPUs with
``lscpu`` (a process), and the replicas get one physical core each."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engines.vllm.placement import CPU_BIND_ENV, host_units
from gateway.core.config import Settings
from gateway.local.build import engine_configs

pytestmark = pytest.mark.processes


def test_host_units_on_this_cpu_host(monkeypatch: pytest.MonkeyPatch) -> None:
    units = host_units({})
    assert units.cpu and units.variable == CPU_BIND_ENV
    ids = [int(i) for i in units.ids]  # one per physical core this process may run on
    assert ids and len(ids) == len(set(ids)) and set(ids) <= os.sched_getaffinity(0)
    # a binding the user set stands: nothing to place
    assert host_units({CPU_BIND_ENV: "0-1"}).ids == ()
    assert host_units({CPU_BIND_ENV: "auto"}).ids == units.ids


def test_placement_auto_gives_each_replica_a_core_of_this_host(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(CPU_BIND_ENV, raising=False)
    auto = Settings.model_validate({"engine": {"replicas": 2}})
    placed = [c.placement for c in engine_configs(auto, tmp_path, "m")]
    if len(os.sched_getaffinity(0)) >= 2:  # this host: one core each
        assert all(p and p[0][0] == CPU_BIND_ENV for p in placed)
        assert placed[0] != placed[1]
    else:
        assert placed == [(), ()]
