"""``vcache serve --workers N``: N gateway processes on one port.

The parent starts N copies of the command it was started with, each with
``VCACHE_WORKER_INDEX`` set.  It holds no socket that serves and no state;
with embedded replicas it runs their engine cores, each worker a client of
them (``engines/vllm/shared_core.py``).  Each worker binds the HTTP and gRPC ports with
``SO_REUSEPORT``, so the kernel spreads new connections over the workers;
each subscribes to every replica's KV events itself (its exact index needs
nothing shared), and all of them share the session log (SQLite in WAL mode
across processes, or PostgreSQL) and, with ``state.url``, the soft state.
Without ``state.url`` each worker keeps its own provider belief and only
worker 0 runs the provider control loop's heartbeats and the log's retention.
``/metrics``, whichever worker answers, sums every worker's counters (one
``PROMETHEUS_MULTIPROC_DIR`` for all, made and removed by the parent).

A worker that dies is started again (after 1 s, doubling to 30 s while it
keeps dying young); its engine pin holds run out on their own.  A worker
attached to engine cores cannot attach again: the others serve on, and when
the last has died or a core has, the parent starts the set again.  SIGTERM or
SIGINT to the parent stops the workers gracefully (they finish what they
serve, up to 30 s), then the parent exits.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engines.vllm.lifeline import GATEWAY_PID_ENV
from engines.vllm.shared_core import SLOTS_ENV, SharedCores, slots_to_env
from gateway.core.metrics import MULTIPROC_ENV

log = logging.getLogger(__name__)
WORKER_ENV = "VCACHE_WORKER_INDEX"
STOP_GRACE_S = 30.0
DEAD_GRACE_S = 3.0  # the engine core is gone: what the workers serve from it cannot finish
YOUNG_S = 10.0  # a worker that dies younger than this is restarted with backoff


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` that other workers bind too."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    backoff_s: float = 1.0
    due: float = 0.0  # when to start it again
    gone: bool = False  # exited, and cannot be started again (it was attached to cores)


Spawn = Callable[[int], "subprocess.Popen[bytes]"]


def run_workers(
    n: int, host: str, port: int, argv: Sequence[str], cores: SharedCores | None = None
) -> int:
    """The parent of ``n`` workers running ``argv`` (the ``vcache`` arguments), and of the
    embedded replicas' engine ``cores`` when there are any."""
    # fail at once, not in a crash loop, when the port belongs to another program
    probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        probe.bind((host, port))
    except OSError as exc:
        print(f"vcache: cannot bind {host}:{port} for the workers: {exc}", file=sys.stderr)
        return 1
    finally:
        probe.close()
    stopping = False

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, stop)
    cmd = [sys.executable, "-m", "gateway.cli", *argv]
    metrics = tempfile.mkdtemp(prefix="vcache-metrics-")  # every worker's counters
    # every worker dies with this process (engines/vllm/lifeline.py)
    env = {**os.environ, MULTIPROC_ENV: metrics, GATEWAY_PID_ENV: str(os.getpid())}
    try:
        if cores is None:

            def spawn(i: int) -> subprocess.Popen[bytes]:
                return subprocess.Popen(cmd, env={**env, WORKER_ENV: str(i)})

            _supervise(n, spawn, lambda: stopping)
            return 0
        return _serve_with_cores(n, cmd, env, cores, lambda: stopping)
    finally:
        shutil.rmtree(metrics, ignore_errors=True)


def _serve_with_cores(
    n: int, cmd: list[str], env: dict[str, str], cores: SharedCores, stopping: Callable[[], bool]
) -> int:
    """Start the engine cores, then the workers attached to them; start the set again
    (backing off while it keeps failing young) when a core dies or every worker has."""
    backoff_s = 1.0
    while not stopping():
        started = time.monotonic()
        try:
            cores.start()
            why = (
                None
                if stopping()
                else _supervise(
                    n, _attached(cmd, env, cores), stopping, restart=False, dead=cores.dead
                )
            )
        except Exception as exc:
            log.exception("the engine cores failed to start")
            why = f"{type(exc).__name__}: {exc}"
        finally:
            cores.close()
        if why is None:
            break
        lived = time.monotonic() - started
        backoff_s = min(backoff_s * 2, 60.0) if lived < 2 * YOUNG_S else 1.0
        log.error("restarting the engines and workers in %.0f s: %s", backoff_s, why)
        deadline = time.monotonic() + backoff_s
        while not stopping() and time.monotonic() < deadline:
            time.sleep(0.2)
    return 0


def _attached(cmd: list[str], env: dict[str, str], cores: SharedCores) -> Spawn:
    def spawn(i: int) -> subprocess.Popen[bytes]:
        slots = slots_to_env(cores.runtime_dir, cores.slots(i))
        worker_env = {**env, WORKER_ENV: str(i), SLOTS_ENV: slots}
        return subprocess.Popen(cmd, env=worker_env, pass_fds=cores.fds(i))

    return spawn


def _supervise(
    n: int,
    spawn: Spawn,
    stopping: Callable[[], bool],
    *,
    restart: bool = True,
    dead: Callable[[], str | None] = lambda: None,
) -> str | None:
    """Run ``n`` workers until ``stopping()`` (None) or until what they serve from is
    gone: ``dead()`` names it, or, for workers that cannot ``restart``, every worker
    has exited.  A worker that can is started again, with backoff while it dies young."""
    workers = [_Worker(i) for i in range(n)]
    log.info("vcache: %d workers", n)
    while not stopping():
        if (why := dead()) is not None:
            _stop(workers, DEAD_GRACE_S)
            return why
        now = time.monotonic()
        for w in workers:
            if w.proc is not None and w.proc.poll() is not None:
                code, lived = w.proc.returncode, now - w.started
                w.backoff_s = min(w.backoff_s * 2, 30.0) if lived < YOUNG_S else 1.0
                w.due, w.proc, w.gone = now + w.backoff_s, None, not restart
                if restart:
                    log.warning(
                        "worker %d exited (%s) after %.0f s; again in %.0f s",
                        w.index,
                        code,
                        lived,
                        w.backoff_s,
                    )
                else:
                    log.error(
                        "worker %d exited (%s) after %.0f s; the others serve (a "
                        "worker cannot attach to running engine cores again)",
                        w.index,
                        code,
                        lived,
                    )
            if w.proc is None and not w.gone and now >= w.due:
                w.proc, w.started = spawn(w.index), now
        if all(w.gone for w in workers):
            return "every worker exited"
        time.sleep(0.2)
    _stop(workers, STOP_GRACE_S)
    return None


def _stop(workers: list[_Worker], grace_s: float) -> None:
    live = [w.proc for w in workers if w.proc is not None and w.proc.poll() is None]
    for p in live:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in live:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
