"""Engine lifecycle on the real engine, in a gateway of its own (it is killed here).

An engine core killed under the gateway is noticed, reported (healthz 503,
readyz ``engine_dead``, gRPC NOT_SERVING, 503 with Retry-After), restarted,
resynced and probed, and the gateway serves again without being restarted.
Then the gateway is killed with SIGKILL: its engine processes die with it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.core.config import hash_api_key
from tests.integration.conftest import KEY_A, _free_port, running, wait_for

pytestmark = pytest.mark.integration

CHAT = {"model": "vcache-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def lone_gateway(
    data_dir: Path, demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[psutil.Process, str, str]]:
    port, grpc_port = _free_port(), _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCACHE_")}
    env["VCACHE_API_KEYS"] = json.dumps([{"sha256": hash_api_key(KEY_A), "admin": True}])
    env["VCACHE_ENGINE__RESTART_BACKOFF_S"] = "0.5"
    env["VCACHE_SESSION_LOG__PATH"] = str(tmp_path_factory.mktemp("lone") / "sessions.db")
    cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--port",
        str(port),
        "--grpc-port",
        str(grpc_port),
        "--data-dir",
        str(data_dir),
        "--kv-cache-bytes",
        str(32 << 20),
        "--max-model-len",
        "2048",
        "--enforce-eager",
    ]
    log_path = tmp_path_factory.mktemp("lone") / "gateway.log"
    base = f"http://127.0.0.1:{port}"
    with running(cmd, env, f"{base}/readyz", log_path, "gateway") as proc:
        yield psutil.Process(proc.pid), base, f"127.0.0.1:{grpc_port}"


def _grpc_health(target: str) -> int:
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return int(stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status)


def _engine_cores(gw: psutil.Process) -> list[psutil.Process]:
    return [p for p in gw.children(recursive=True) if p.name() == "VLLM::EngineCore"]


def test_a_killed_engine_core_is_restarted_without_restarting_the_gateway(
    lone_gateway: tuple[psutil.Process, str, str],
) -> None:
    gw, base, grpc_target = lone_gateway
    auth = {"authorization": f"Bearer {KEY_A}"}
    assert httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers=auth).status_code == 200
    (core,) = _engine_cores(gw)
    core.kill()

    def dead() -> bool:
        return httpx.get(f"{base}/healthz").status_code == 503

    wait_for(dead, timeout_s=30)
    ready = httpx.get(f"{base}/readyz")
    assert ready.status_code == 503 and ready.json()["status"] == "engine_dead"
    assert _grpc_health(grpc_target) == health_pb2.HealthCheckResponse.NOT_SERVING
    r = httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers=auth)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "engine_unavailable"
    assert int(r.headers["retry-after"]) >= 1
    stats = httpx.get(f"{base}/v1/cache/stats", headers=auth)
    assert stats.status_code == 200  # no 500 while the replica is dead
    assert stats.json()["replicas"]["replica-0"]["live"] is False

    wait_for(lambda: httpx.get(f"{base}/readyz").status_code == 200, timeout_s=180)
    body = httpx.get(f"{base}/readyz").json()
    assert body["replicas"]["replica-0"]["restarts"] == 1
    assert gw.is_running()  # the same gateway process
    assert _grpc_health(grpc_target) == health_pb2.HealthCheckResponse.SERVING
    (new_core,) = _engine_cores(gw)
    assert new_core.pid != core.pid
    r = httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers=auth)
    assert r.status_code == 200
    rep = httpx.get(f"{base}/v1/cache/stats", headers=auth).json()["replicas"]["replica-0"]
    assert rep["live"] is True and rep["hash_agreement"] == "exact"  # probed again


def test_engine_processes_die_with_a_killed_gateway(
    lone_gateway: tuple[psutil.Process, str, str],
) -> None:
    gw = lone_gateway[0]
    engines = gw.children(recursive=True)
    assert any(p.name() == "VLLM::EngineCore" for p in engines)
    os.kill(gw.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in engines):
        assert time.monotonic() < deadline, [p.name() for p in engines if p.is_running()]
        time.sleep(0.2)
