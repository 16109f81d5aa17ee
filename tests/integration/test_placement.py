"""The shared gateway's two embedded replicas compute on their own CPU cores, at the
niceness engine.nice gives them.

vLLM alone binds every engine's OpenMP threads to the first cores of the host
(on a 2-core host all to core 0), so two replicas would take turns on one core;
the gateway gives each its own (engines/vllm/placement.py).  Read from the
kernel: the CPUs each model-runner process (``VLLM::Worker``, a descendant of
the gateway) may run on.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.integration.conftest import ENGINE_NICE, REPLICAS, Gateway

PROC = Path("/proc")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in (PROC / str(pid) / "task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        found += kids
        todo += kids
    return found


def _comm(pid: int) -> str:
    try:
        return (PROC / str(pid) / "comm").read_text().strip()
    except OSError:  # gone since it was listed
        return ""


def _allowed(pid: int) -> set[int]:
    """The CPUs every thread of ``pid`` may run on (the union over its threads)."""
    cpus: set[int] = set()
    for task in (PROC / str(pid) / "task").glob("*"):
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                for part in line.split(":", 1)[1].strip().split(","):
                    lo, _, hi = part.partition("-")
                    cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < REPLICAS, reason="fewer CPU cores than replicas to place"
)
def test_each_replica_computes_on_its_own_cores(gateway: Gateway) -> None:
    if not (PROC / str(gateway.pid) / "task").is_dir():
        pytest.skip("no /proc here to read the gateway's processes from")
    runners = [p for p in _descendants(gateway.pid) if _comm(p) == "VLLM::Worker"]
    assert len(runners) == REPLICAS, runners
    sets = [_allowed(p) for p in runners]
    host = os.sched_getaffinity(0)
    assert all(s and s <= host for s in sets), sets
    # no core is given to two replicas, and on a host with more cores than replicas one
    # is kept for the gateway
    assert sum(len(s) for s in sets) == len(set().union(*sets)), sets
    if len(host) > REPLICAS:
        assert set().union(*sets) < host, sets


def _nices(pid: int) -> set[int]:
    """The niceness of every thread of ``pid`` (the 19th field of each task's stat)."""
    got: set[int] = set()
    for task in (PROC / str(pid) / "task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:  # a thread gone since it was listed
            continue
        got.add(int(stat.rsplit(")", 1)[1].split()[16]))
    return got


def test_the_engine_processes_run_at_the_configured_niceness(gateway: Gateway) -> None:
    if not (PROC / str(gateway.pid) / "task").is_dir():
        pytest.skip("no /proc here to read the gateway's processes from")
    engines = [p for p in _descendants(gateway.pid) if _comm(p).startswith("VLLM::")]
    # per replica its engine core and its model runner
    assert [_comm(p) for p in engines].count("VLLM::Worker") == REPLICAS, engines
    assert len(engines) >= 2 * REPLICAS, engines
    own = os.getpriority(os.PRIO_PROCESS, 0)  # the gateway's, as this process's
    assert _nices(gateway.pid) == {own}
    for pid in engines:  # engine.nice above the gateway's, at most 19
        assert _nices(pid) == {min(19, own + ENGINE_NICE)}, (_comm(pid), _nices(pid))
