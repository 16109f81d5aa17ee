"""The engine processes' CPU priority, below the gateway's where they share cores.

A vLLM engine core is one busy process per replica: on CPU it computes the
model on its OpenMP threads, on a GPU host it still runs its scheduler loop,
detokenizes and publishes KV events on the host's cores.  When the gateway
runs beside its engines on the same cores (a small host, or more replicas
than cores), the gateway's own work for a request (tokenizing, rendering the
chat template, planning, streaming each token out) waits for CPU time behind
the engines' steps, and under a flood that wait lands on every first token.

``engine.nice`` (``gateway/core/engine_settings.py``) puts the engine
processes that much below the gateway's own niceness (as ``nice -n`` does, at
most 19): the kernel then gives the gateway the CPU first when both are
runnable, while the engines keep every cycle the gateway leaves (measured on
a 2-core CPU host in docs/notebook_agents.md).  Unset, it is :data:`CPU_NICE` on a CPU
host, where the engines compute on the gateway's cores by design, and 0 on an
accelerator host, where the engines compute on their devices and the host
has cores to spare (not measured: no GPU here).

The gateway sets :data:`NICE_ENV` (the absolute niceness) in the environment
its engine cores inherit; the vcache vLLM plugin calls :func:`apply_from_env`
in each engine process (core and workers), which sets the niceness of every
thread the process has so far (Linux keeps a niceness per thread; threads
started later inherit their creator's).  Raising one's own niceness needs no
privilege; nothing is done in a process that lacks the variable (the
gateway, ``vllm serve`` replicas).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping

log = logging.getLogger("vllm.vcache.niceness")

NICE_ENV = "VCACHE_ENGINE_NICE"
CPU_NICE = 10  # engine.nice unset, on a CPU host


def engine_nice(configured: int | None, cpu: bool, own: int = 0) -> int:
    """The engines' niceness, for a gateway at niceness ``own``: ``engine.nice`` (where
    set; else :data:`CPU_NICE` on a CPU host, 0 on an accelerator host) above it, at
    most 19."""
    step = configured if configured is not None else (CPU_NICE if cpu else 0)
    return min(19, own + step)


def _threads() -> Iterable[int]:
    """This process's thread ids (Linux), or only the process itself elsewhere."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def set_niceness(nice: int) -> None:
    """Give every thread of this process the niceness ``nice`` (0-19); a thread that has
    exited since it was listed is skipped."""
    for tid in _threads():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            continue


def apply_from_env(environ: Mapping[str, str] = os.environ) -> int | None:
    """In an engine process the gateway started: its niceness as the gateway set it
    (:data:`NICE_ENV`); None where the variable is absent or not a niceness."""
    raw = environ.get(NICE_ENV)
    if raw is None:
        return None
    try:
        nice = int(raw)
    except ValueError:
        log.warning("%s=%r is not a niceness; left as it is", NICE_ENV, raw)
        return None
    if not 0 <= nice <= 19:
        log.warning("%s=%d is outside 0-19; left as it is", NICE_ENV, nice)
        return None
    if os.getpriority(os.PRIO_PROCESS, 0) != nice:
        try:
            set_niceness(nice)
        except PermissionError:  # below what this process has: only a privileged one may
            log.warning(
                "niceness %d refused (this process has %d); left as it is",
                nice,
                os.getpriority(os.PRIO_PROCESS, 0),
            )
            return None
    return nice
