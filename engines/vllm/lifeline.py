"""Engine processes die with the gateway that started them.

vLLM runs its engine core (and, with the multiprocessing executor, its
workers) in child processes.  If the gateway is killed (``kill -9``, an OOM
kill, a lost terminal) those children are re-parented to PID 1 and keep the
model and its KV cache in memory (GPU memory on a GPU host) until someone
finds them.  Linux can tie a child's life to its parent: ``PR_SET_PDEATHSIG``
delivers a signal to the child when its parent dies.

The gateway sets :data:`GATEWAY_PID_ENV` to its own pid before it starts an
engine.  The vcache vLLM plugin (loaded by vLLM in every process it starts)
calls :func:`die_with_parent` there: each engine process asks for SIGKILL
when *its* parent dies, so the chain gateway → engine core → workers unwinds
whichever link is cut.  A process whose gateway is already gone by the time
it gets here exits at once.  Nothing happens in the gateway process itself,
nor in ``vllm serve`` replicas, which have no gateway parent.

The signal is tied to the parent *thread* that forked the child: the gateway
starts engines from its long-lived worker threads, which live as long as the
process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

GATEWAY_PID_ENV = "VCACHE_GATEWAY_PID"
_PR_SET_PDEATHSIG = 1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """In an engine process of a gateway: ask for ``sig`` when the parent dies.

    Returns whether the signal was armed (False in the gateway itself, outside
    a gateway, or off Linux).  Exits at once if the gateway is already gone.
    """
    raw = os.environ.get(GATEWAY_PID_ENV)
    if not raw or not raw.isdigit() or not sys.platform.startswith("linux"):
        return False
    gateway = int(raw)
    if os.getpid() == gateway:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    # The parent may have died before the signal was armed: then no signal comes.
    if os.getppid() != gateway and not _alive(gateway):
        os._exit(1)
    return True
