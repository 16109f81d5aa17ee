"""Each embedded replica's own devices or CPU cores (engines/vllm/placement.py): the
plan from a host's ids, the host's CPUs in NUMA order, and the environment an engine
core is spawned with.  (This host's own CPUs, which vLLM reads with ``lscpu``: the
processes tier, tests/processes/test_host_placement.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engines.vllm.placement import (
    CPU_BIND_ENV,
    HostUnits,
    core_env,
    one_per_core,
    plan,
)
from gateway.core.config import Settings
from gateway.local import build
from gateway.local.build import engine_configs


def cpus(n: int) -> HostUnits:
    return HostUnits(cpu=True, variable=CPU_BIND_ENV, ids=tuple(str(i) for i in range(n)))


def gpus(*ids: str) -> HostUnits:
    return HostUnits(cpu=False, variable="CUDA_VISIBLE_DEVICES", ids=ids)


@pytest.mark.parametrize(
    ("units", "replicas", "tp", "expected"),
    [
        # a 2-core host: one core each (vLLM alone would put both on core 0)
        (cpus(2), 2, 1, ["0", "1"]),
        # more cores than replicas: the last one is kept for the gateway
        (cpus(3), 2, 1, ["0", "1"]),
        (cpus(16), 2, 1, ["0,1,2,3,4,5,6", "7,8,9,10,11,12,13"]),
        (cpus(16), 3, 1, ["0,1,2,3,4", "5,6,7,8,9", "10,11,12,13,14"]),
        # tensor parallel on CPU: one core list per rank
        (cpus(9), 2, 2, ["0,1|2,3", "4,5|6,7"]),
        # fewer cores than replicas: vLLM's placement, shared
        (cpus(1), 2, 1, [None, None]),
        (cpus(3), 2, 2, [None, None]),
        # one replica: vLLM's own (NUMA-aware, one core reserved)
        (cpus(8), 1, 1, [None]),
        # accelerators: tensor_parallel_size devices each, in the order this process sees
        (gpus("0", "1", "2", "3"), 2, 1, ["0", "1"]),
        (gpus("0", "1", "2", "3"), 2, 2, ["0,1", "2,3"]),
        (gpus("6", "7"), 2, 1, ["6", "7"]),
        (gpus("GPU-a", "GPU-b"), 2, 1, ["GPU-a", "GPU-b"]),
        (gpus("0"), 2, 1, [None, None]),
        # no ids: a user's own CPU binding stands
        (HostUnits(cpu=True, variable=CPU_BIND_ENV, ids=()), 2, 1, [None, None]),
    ],
)
def test_plan(units: HostUnits, replicas: int, tp: int, expected: list[str | None]) -> None:
    envs = plan(units, replicas, tp)
    assert len(envs) == replicas
    assert [dict(e).get(units.variable) for e in envs] == expected
    placed = [e for e in envs if e]
    assert all(len(e) == 1 for e in placed)  # the one variable, nothing else
    # no id is given to two replicas
    ids = [i for e in placed for i in dict(e)[units.variable].replace("|", ",").split(",")]
    assert len(ids) == len(set(ids))


def test_plan_explicit_is_used_as_given_and_must_list_every_replica() -> None:
    assert plan(cpus(2), 2, 1, ["1", "0"]) == [((CPU_BIND_ENV, "1"),), ((CPU_BIND_ENV, "0"),)]
    assert plan(gpus(), 1, 1, ["3"]) == [(("CUDA_VISIBLE_DEVICES", "3"),)]
    with pytest.raises(ValueError, match="lists 1 entries for 2 replicas"):
        plan(cpus(4), 2, 1, ["0-1"])


def test_one_logical_cpu_per_physical_core_in_numa_order() -> None:
    from vllm.utils.cpu_resource_utils import LogicalCPUInfo as C

    # two nodes, two cores each, SMT-2 (siblings 0/4, 1/5 on node 0; 2/6, 3/7 on node 1)
    cpus = [C(i, i % 4, (i % 4) // 2) for i in range(8)]
    assert one_per_core(cpus) == [4, 5, 6, 7]
    # no SMT, nodes listed out of order: node 0's cores first
    assert one_per_core([C(2, 2, 1), C(0, 0, 0), C(3, 3, 1), C(1, 1, 0)]) == [0, 1, 2, 3]
    assert one_per_core([]) == []


def test_core_env_sets_then_restores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VCACHE_TEST_KEPT", "before")
    monkeypatch.delenv("VCACHE_TEST_NEW", raising=False)
    with core_env((("VCACHE_TEST_KEPT", "inside"), ("VCACHE_TEST_NEW", "x"))):
        assert os.environ["VCACHE_TEST_KEPT"] == "inside"
        assert os.environ["VCACHE_TEST_NEW"] == "x"
    assert os.environ["VCACHE_TEST_KEPT"] == "before"
    assert "VCACHE_TEST_NEW" not in os.environ
    with pytest.raises(RuntimeError), core_env((("VCACHE_TEST_NEW", "y"),)):
        raise RuntimeError
    assert "VCACHE_TEST_NEW" not in os.environ


def test_engine_configs_carry_each_replicas_placement(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(CPU_BIND_ENV, raising=False)
    monkeypatch.setattr(build, "host_units", lambda: cpus(4))  # a 4-core CPU host
    two = Settings.model_validate({"engine": {"replicas": 2, "placement": ["0", "1"]}})
    got = [c.placement for c in engine_configs(two, tmp_path, "m")]
    assert got == [((CPU_BIND_ENV, "0"),), ((CPU_BIND_ENV, "1"),)]
    none = Settings.model_validate({"engine": {"replicas": 2, "placement": "none"}})
    assert [c.placement for c in engine_configs(none, tmp_path, "m")] == [(), ()]
    # (placement auto, from this host's cores: tests/processes/test_host_placement.py)
    with pytest.raises(ValueError, match="lists 1 entries for 2 replicas"):
        Settings.model_validate({"engine": {"replicas": 2, "placement": ["0"]}})
