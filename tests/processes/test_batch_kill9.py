"""A batch survives ``kill -9``: ``vcache serve`` as a real process (provider-only, in
front of the provider emulator as a real process), a batch half done, the gateway
killed with SIGKILL, a new one started on the same data dir: the batch completes,
every item in the output file exactly once, none lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtests.procs import free_port, get_ok

pytestmark = pytest.mark.processes

ITEMS = 300
MODEL = "openai/gpt-5"


@contextmanager
def _proc(cmd: list[str], env: dict[str, str], ready: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180  # a loaded CI machine starts slowly
        while not get_ok(ready):
            assert proc.poll() is None, f"{cmd} exited {proc.returncode}"
            assert time.monotonic() < deadline, f"{cmd} not ready"
            time.sleep(0.2)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def _gateway_cmd(port: int) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port), "--grpc-port", "0"]


def _batch(url: str, bid: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/v1/batches/{bid}", timeout=10)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_a_batch_killed_half_done_completes_after_a_restart(tmp_path: Path) -> None:
    emu_port, port = free_port(), free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("VCACHE_")}
    emulator = [sys.executable, "-m", "loadtests.emulator", "--port", str(emu_port)]
    env = dict(base)
    env["VCACHE_PROVIDERS"] = json.dumps(
        {"openai": {"base_url": f"http://127.0.0.1:{emu_port}/v1", "api_key": "k"}}
    )
    env["VCACHE_ENGINE__REPLICAS"] = "0"
    env["VCACHE_DATA_DIR"] = str(tmp_path / "data")
    env["VCACHE_SESSION_LOG__PATH"] = str(tmp_path / "data" / "s.db")
    env["VCACHE_BATCHES__CONCURRENCY"] = "2"
    env["VCACHE_BATCHES__LEASE_S"] = "2"  # the dead gateway's claims run out quickly
    env["VCACHE_BATCHES__POLL_S"] = "0.2"
    url = f"http://127.0.0.1:{port}"
    lines = [
        {
            "custom_id": f"item-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "max_tokens": 4,
                "messages": [
                    {"role": "system", "content": f"Instruction set {i % 5}. " * 40},
                    {"role": "user", "content": f"question {i}"},
                ],
            },
        }
        for i in range(ITEMS)
    ]
    upload = "".join(json.dumps(x) + "\n" for x in lines).encode()
    with _proc(emulator, base, f"http://127.0.0.1:{emu_port}/admin/billing"):
        with _proc(_gateway_cmd(port), env, f"{url}/readyz") as first:
            f = httpx.post(
                f"{url}/v1/files",
                files={"file": ("in.jsonl", upload)},
                data={"purpose": "batch"},
                timeout=30,
            ).json()
            b = httpx.post(
                f"{url}/v1/batches",
                json={
                    "input_file_id": f["id"],
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
                timeout=30,
            ).json()
            deadline = time.monotonic() + 120
            while (done := _batch(url, b["id"])["request_counts"]["completed"]) < ITEMS // 10:
                assert time.monotonic() < deadline, "the batch did not start"
                time.sleep(0.05)
            os.kill(first.pid, signal.SIGKILL)  # mid-batch, no shutdown at all
            first.wait(timeout=30)
        assert done < ITEMS, "the batch finished before the kill: not half done"

        with _proc(_gateway_cmd(port), env, f"{url}/readyz"):
            deadline = time.monotonic() + 240
            while (row := _batch(url, b["id"]))["status"] != "completed":
                assert row["status"] == "in_progress", row
                assert time.monotonic() < deadline, row["request_counts"]
                time.sleep(0.2)
            out = httpx.get(f"{url}/v1/files/{row['output_file_id']}/content", timeout=30)
    assert row["error_file_id"] is None
    assert row["request_counts"] == {"total": ITEMS, "completed": ITEMS, "failed": 0}
    answered = [json.loads(x)["custom_id"] for x in out.text.splitlines()]
    assert len(answered) == len(set(answered)) == ITEMS  # none twice, none lost
    assert set(answered) == {x["custom_id"] for x in lines}
