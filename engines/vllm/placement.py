"""Where each embedded replica computes: its own accelerators, or its own CPU cores.

vLLM assumes one engine per host.  On CUDA an engine takes the visible devices
from the first; on CPU it binds its OpenMP threads to the first NUMA node's
cores, less one kept for the host (on a 2-core host: core 0, for every
engine).  Two embedded replicas started that way compute on the same device
or core, so each one's work slows the other.  The gateway gives each replica
a slice of its own before that replica's engine core starts, through the
variable vLLM reads in the core's process:

- accelerators: the platform's device variable (``CUDA_VISIBLE_DEVICES``),
  ``tensor_parallel_size`` devices per replica, taken in order from those this
  process sees;
- CPU: ``VLLM_CPU_OMP_THREADS_BIND``, contiguous physical cores (one logical
  CPU each, in NUMA-node order, as vLLM's own ``lscpu`` reading gives them),
  one kept for the gateway where there are more cores than replicas; with
  tensor parallelism a replica's cores are split between its ranks
  (``"0-3|4-7"``).

``engine.placement`` (``gateway/core/engine_settings.py``): ``auto`` (the
default) splits as above where there are enough devices or cores and leaves
vLLM's own placement otherwise (with a warning: the replicas share);
``none`` always leaves it to vLLM; a list gives each replica its own ids
(device ids, or CPU core lists such as ``"0-7"``).  A single replica is left
to vLLM, as is a CPU host whose ``VLLM_CPU_OMP_THREADS_BIND`` is set already.

:func:`plan` is pure (ids in, one environment per replica out);
:func:`host_units` reads the host; :func:`core_env` applies one replica's
environment while its engine core is spawned (it inherits it) and restores
this process's afterwards.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"

Env = tuple[tuple[str, str], ...]  # one engine core's environment overrides


@dataclass(frozen=True)
class HostUnits:
    """What this host's replicas can be placed on: ``variable`` names the environment
    variable that confines an engine core to some of ``ids`` (device ids as the
    variable spells them, or CPU cores); no ids: placing is left to vLLM."""

    cpu: bool
    variable: str
    ids: tuple[str, ...]


def plan(units: HostUnits, replicas: int, tp: int, explicit: Sequence[str] = ()) -> list[Env]:
    """Per replica, the environment that confines its engine core to its own slice of
    ``units`` (empty: vLLM's own placement).  ``explicit``: ``engine.placement``'s
    list, one entry per replica, used as given."""
    if explicit:
        if len(explicit) != replicas:
            raise ValueError(
                f"engine.placement lists {len(explicit)} entries for {replicas} replicas"
            )
        return [((units.variable, entry),) for entry in explicit]
    if replicas < 2 or not units.ids:
        return [()] * replicas
    ids = list(units.ids)
    if units.cpu and len(ids) > replicas:
        ids = ids[:-1]  # one core for the gateway, the schedulers and the host
    # a replica's share: on CPU all the cores it can have, on accelerators its TP group
    per = len(ids) // replicas if units.cpu else tp
    if len(ids) < replicas * tp:
        log.warning(
            "%d replicas x tensor_parallel_size %d need %d %s; %d here: the replicas share "
            "them (set engine.placement to place them yourself)",
            replicas,
            tp,
            replicas * tp,
            "cores" if units.cpu else "devices",
            len(units.ids),
        )
        return [()] * replicas
    out: list[Env] = []
    for r in range(replicas):
        mine = ids[r * per : (r + 1) * per]
        if units.cpu:  # one core list per tensor-parallel rank
            rank = len(mine) // tp
            value = "|".join(",".join(mine[k * rank : (k + 1) * rank]) for k in range(tp))
        else:
            value = ",".join(mine)
        out.append(((units.variable, value),))
    return out


def one_per_core(cpus: Iterable[Any]) -> list[int]:
    """vLLM's ``LogicalCPUInfo`` list as the ids to bind: one logical CPU per physical
    core (the last, as vLLM's own binding takes on x86: OpenMP threads on SMT siblings
    slow each other), in NUMA-node order."""
    last: dict[tuple[int, int], int] = {}
    for c in sorted(cpus, key=lambda c: (c.numa_node, c.physical_core, c.id)):
        last[(c.numa_node, c.physical_core)] = c.id
    return list(last.values())


def host_units(environ: Mapping[str, str] = os.environ) -> HostUnits:
    """This host's devices, or its CPU cores, as vLLM's platform sees them (none on a
    CPU host whose ``VLLM_CPU_OMP_THREADS_BIND`` the user set: theirs stands)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        if environ.get(CPU_BIND_ENV, "auto") != "auto":
            return HostUnits(cpu=True, variable=CPU_BIND_ENV, ids=())
        from vllm.utils.cpu_resource_utils import get_allowed_cpu_list

        cpus = one_per_core(get_allowed_cpu_list())
        return HostUnits(cpu=True, variable=CPU_BIND_ENV, ids=tuple(map(str, cpus)))
    variable = str(current_platform.device_control_env_var)
    visible = [x.strip() for x in environ.get(variable, "").split(",") if x.strip()]
    ids = visible or [str(i) for i in range(current_platform.device_count())]
    return HostUnits(cpu=False, variable=variable, ids=tuple(ids))


@contextmanager
def core_env(env: Env) -> Iterator[None]:
    """``env`` in this process's environment while the block runs (an engine core
    spawned in it inherits it), then the environment as it was."""
    saved = {k: os.environ.get(k) for k, _ in env}
    os.environ.update(dict(env))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
