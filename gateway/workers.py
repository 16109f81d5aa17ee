"""``vcache serve --workers N``: N gateway processes on one port.

The parent starts N copies of the command it was started with, each with
``VCACHE_WORKER_INDEX`` set, and does nothing else: it holds no socket that
serves, no engine, no state.  Each worker binds the HTTP and gRPC ports with
``SO_REUSEPORT``, so the kernel spreads new connections over the workers;
each subscribes to every replica's KV events itself (its exact index needs
nothing shared), and all of them share the session log (SQLite in WAL mode
across processes, or PostgreSQL) and, with ``state.url``, the soft state.
Without ``state.url`` each worker keeps its own provider belief and only
worker 0 runs the provider control loop's heartbeats and the log's retention.
``/metrics``, whichever worker answers, sums every worker's counters (one
``PROMETHEUS_MULTIPROC_DIR`` for all, made and removed by the parent).

A worker that dies is started again (after 1 s, doubling to 30 s while it
keeps dying young); its engine pin holds run out on their own.  SIGTERM or
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

from gateway.core.metrics import MULTIPROC_ENV

log = logging.getLogger(__name__)
WORKER_ENV = "VCACHE_WORKER_INDEX"
STOP_GRACE_S = 30.0
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


def run_workers(n: int, host: str, port: int, argv: Sequence[str]) -> int:
    """The parent of ``n`` workers running ``argv`` (the ``vcache`` arguments)."""
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
    try:
        return _supervise(n, cmd, metrics, lambda: stopping)
    finally:
        shutil.rmtree(metrics, ignore_errors=True)


def _supervise(n: int, cmd: list[str], metrics: str, stopping: Callable[[], bool]) -> int:
    workers = [_Worker(i) for i in range(n)]
    log.info("vcache: %d workers", n)
    while not stopping():
        now = time.monotonic()
        for w in workers:
            if w.proc is not None and w.proc.poll() is not None:
                code, lived = w.proc.returncode, now - w.started
                w.backoff_s = min(w.backoff_s * 2, 30.0) if lived < YOUNG_S else 1.0
                w.due, w.proc = now + w.backoff_s, None
                log.warning("worker %d exited (%s) after %.0f s; again in %.0f s",
                            w.index, code, lived, w.backoff_s)  # fmt: skip
            if w.proc is None and now >= w.due:
                env = {**os.environ, WORKER_ENV: str(w.index), MULTIPROC_ENV: metrics}
                w.proc, w.started = subprocess.Popen(cmd, env=env), now
        time.sleep(0.2)
    return _stop(workers)


def _stop(workers: list[_Worker]) -> int:
    live = [w.proc for w in workers if w.proc is not None and w.proc.poll() is None]
    for p in live:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in live:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return 0
