"""``vcache serve`` shuts down cleanly on SIGHUP (a lost terminal), as on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from loadtests.procs import free_port, get_ok

pytestmark = pytest.mark.processes


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_serve_shuts_down_cleanly(sig: signal.Signals, tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCACHE_")}
    # a provider-only gateway starts in seconds (no engine); the provider is never called
    env["VCACHE_PROVIDERS"] = json.dumps({"openai": {"base_url": "http://127.0.0.1:9/v1"}})
    env["VCACHE_ENGINE__REPLICAS"] = "0"
    env["VCACHE_SESSION_LOG__PATH"] = str(tmp_path / "s.db")
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--grpc-port", "0"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not get_ok(f"http://127.0.0.1:{port}/readyz"):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # uvicorn shuts down gracefully, then re-raises the signal it handled (SIGHUP was turned
    # into SIGTERM), so the exit status is that of SIGTERM
    assert proc.returncode == -signal.SIGTERM, out.decode()[-2000:]
    assert b"Shutting down" in out and b"Application shutdown complete" in out
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
