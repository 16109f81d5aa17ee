"""``vcache serve --workers 2`` in front of the provider emulator, as a user runs it: two
worker processes on one port, both serving, one log; a worker killed is started again
while the other serves; SIGTERM stops them all."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests.integration.conftest import _free_port, running, wait_for
from tests.providers.conftest import MODELS, PROVIDER_KEY, Emulator

pytestmark = pytest.mark.processes  # the workers, and the emulator they reach

MODEL = f"openai/{MODELS['openai']}"


@pytest.fixture
def workers(
    emulator_server: Emulator, tmp_path: Path
) -> Iterator[tuple[str, psutil.Process, Path]]:
    emulator = emulator_server  # the workers are processes of their own
    emulator.admin("reset")  # no limits or faults left by other tests
    config = {
        "providers": {"openai": {"base_url": emulator.base_url("openai"), "api_key": PROVIDER_KEY}},
        "session_log": {"path": str(tmp_path / "sessions.db")},
    }
    (tmp_path / "vcache.yaml").write_text(yaml.safe_dump(config))
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--workers",
        "2",
        "--replicas",
        "0",
        "--port",
        str(port),
        "--grpc-port",
        str(_free_port()),
        "--config",
        str(tmp_path / "vcache.yaml"),
        "--data-dir",
        str(tmp_path),
    ]
    url = f"http://127.0.0.1:{port}"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    with running(cmd, env, f"{url}/readyz", tmp_path / "gateway.log", "workers") as proc:
        parent = psutil.Process(proc.pid)
        wait_for(lambda: len(parent.children()) == 2)
        wait_for(lambda: _ready_everywhere(url), timeout_s=60)
        yield url, parent, tmp_path / "sessions.db"


def _ready_everywhere(url: str) -> bool:
    """/readyz on ten fresh connections: every worker that takes one is ready."""
    return all(httpx.get(f"{url}/readyz", timeout=5).status_code == 200 for _ in range(10))


def _ask(url: str, i: int) -> httpx.Response:
    body = {
        "model": MODEL,
        "max_tokens": 3,
        "messages": [{"role": "user", "content": f"question {i}"}],
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)  # a new connection


def _cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)


def test_two_workers_share_the_port_and_the_log(
    workers: tuple[str, psutil.Process, Path],
) -> None:
    url, parent, db = workers
    kids = parent.children()
    before = [_cpu(k) for k in kids]
    ids = []
    for i in range(100):
        r = _ask(url, i)
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    spent = [_cpu(k) - b for k, b in zip(kids, before, strict=True)]
    print(f"\nCPU of each worker over 100 requests: {[round(s, 2) for s in spent]} s")
    assert all(s > 0.04 for s in spent)  # both served (an idle worker spends ~nothing)
    with sqlite3.connect(db) as con:
        logged = {r[0] for r in con.execute("SELECT request_id FROM requests")}
    assert set(ids) <= logged  # one log, written by both
    # /metrics, whichever worker answers, counts both workers' requests
    for _ in range(4):
        text = httpx.get(f"{url}/metrics", timeout=10).text
        served = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vcache_requests_total{")
            and 'route="/v1/chat/completions"' in line
            and 'status="200"' in line
        )
        assert served == 100


def test_a_killed_worker_is_started_again_while_the_other_serves(
    workers: tuple[str, psutil.Process, Path],
) -> None:
    url, parent, _ = workers
    victim, survivor = parent.children()
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    served = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            served += _ask(url, served).status_code == 200
        except httpx.TransportError:  # a connection the dying worker had taken
            continue
        kids = parent.children()
        if len(kids) == 2 and victim.pid not in {k.pid for k in kids} and served >= 10:
            break
    assert served >= 10  # the survivor served throughout
    kids = parent.children()
    assert len(kids) == 2 and survivor in kids and victim.pid not in {k.pid for k in kids}
    wait_for(lambda: _ready_everywhere(url), timeout_s=60)


def test_sigterm_stops_every_worker(workers: tuple[str, psutil.Process, Path]) -> None:
    _, parent, _ = workers
    kids = parent.children()
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(40) == 0
    _, alive = psutil.wait_procs(kids, timeout=5)
    assert alive == []


def test_workers_refuse_a_port_picked_per_process() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--workers", "2", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "share one port" in out.stderr
