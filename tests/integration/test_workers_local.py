"""``vcache serve --workers 2`` over an embedded replica, as a user runs it: one vLLM
engine core in the parent, two gateway workers attached to it as vLLM's
multi-frontend clients; a prefix one worker's request stored is served to the
other's, predicted exactly; a lost worker leaves the other serving; a lost
engine core restarts the set; every request rebuilds from the one log."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import signal
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.integration.conftest import (
    ADMIN,
    ADMIN_KEYS,
    _free_port,
    _log_tail,
    rebuild_all,
    running,
    wait_for,
)

pytestmark = pytest.mark.integration

KV_CACHE_BYTES = 32 << 20  # 128 blocks of 128 tokens with the demo model
BLOCK = 128


@dataclass(frozen=True)
class Pool:
    port: int
    parent: psutil.Process
    log: Path
    closing: contextlib.ExitStack  # the connections handed out, closed with the pool

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def workers(self) -> list[psutil.Process]:
        return [p for p in self.parent.children() if "gateway.cli" in " ".join(p.cmdline())]

    def cores(self) -> list[psutil.Process]:
        return [p for p in self.parent.children() if "EngineCore" in p.name()]

    def connect(self, worker: psutil.Process) -> http.client.HTTPConnection:
        """A connection that the kernel gave to ``worker`` (SO_REUSEPORT spreads them)."""
        for _ in range(200):
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            conn.connect()
            mine = conn.sock.getsockname()[1]
            if any(c.raddr and c.raddr.port == mine for c in worker.net_connections("tcp")):
                self.closing.callback(conn.close)
                return conn
            conn.close()
        pytest.fail(f"no connection of 200 went to worker {worker.pid}")


def _ready_everywhere(pool: Pool) -> bool:
    try:
        codes = [httpx.get(f"{pool.url}/readyz", timeout=5).status_code for _ in range(10)]
    except httpx.TransportError:
        return False
    return len(pool.workers()) == 2 and all(c == 200 for c in codes)


def _await_ready(pool: Pool, timeout_s: float) -> None:
    """Both workers ready within ``timeout_s``, or fail with what the pool logged."""
    deadline = time.monotonic() + timeout_s
    while not _ready_everywhere(pool):
        if time.monotonic() > deadline:
            pytest.fail(f"the pool is not ready in {timeout_s}s; its log:\n{_log_tail(pool.log)}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def pool(
    data_dir: Path, demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pool]:
    tmp = tmp_path_factory.mktemp("workers-local")
    sessions = tmp / "sessions.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCACHE_")}
    env["VCACHE_SESSION_LOG__PATH"] = str(sessions)
    env["VCACHE_SESSION_LOG__VERIFY_RECONSTRUCTION"] = "true"
    env |= ADMIN_KEYS
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--workers",
        "2",
        "--replicas",
        "1",
        "--port",
        str(port),
        "--grpc-port",
        str(_free_port()),
        "--data-dir",
        str(data_dir),
        "--kv-cache-bytes",
        str(KV_CACHE_BYTES),
        "--max-model-len",
        "2048",
        "--enforce-eager",
    ]
    ready = f"http://127.0.0.1:{port}/readyz"
    with (
        running(cmd, env, ready, tmp / "gateway.log", "workers") as p,
        contextlib.ExitStack() as closing,
    ):
        pool = Pool(port, psutil.Process(p.pid), tmp / "gateway.log", closing)
        _await_ready(pool, timeout_s=120)
        yield pool
    rebuilt, failed = rebuild_all(sessions, demo_model)
    assert rebuilt > 0 and not failed, f"requests that do not rebuild: {failed}"


def _gone(p: psutil.Process) -> bool:
    try:
        return bool(p.status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _text(seed: int, words: int = 600) -> str:
    vocab = ["cache", "block", "token", "model", "answer", "prompt", "worker", "engine"]
    return " ".join(random.Random(seed).choices(vocab, k=words))


def _post(
    conn: http.client.HTTPConnection, path: str, body: dict[str, Any]
) -> tuple[http.client.HTTPResponse, Any]:
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json", **ADMIN})
    r = conn.getresponse()
    return r, json.loads(r.read())


def _messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _chat(conn: http.client.HTTPConnection, text: str) -> tuple[int, dict[str, Any], int | None]:
    """(status, usage, the gateway's predicted cached tokens) of one chat request."""
    body = {"model": "vcache-demo", "max_tokens": 2, "messages": _messages(text)}
    r, data = _post(conn, "/v1/chat/completions", body)
    predicted = r.getheader("x-vcache-predicted-cached-tokens")
    return r.status, data.get("usage", data), None if predicted is None else int(predicted)


def test_one_engine_core_serves_both_workers_with_exact_spans(pool: Pool) -> None:
    assert len(pool.cores()) == 1 and len(pool.workers()) == 2
    for worker in pool.workers():
        conn = pool.connect(worker)
        conn.request("GET", "/v1/cache/stats", headers=ADMIN)
        stats = json.loads(conn.getresponse().read())
        replica = stats["replicas"]["replica-0"]
        # the probe and the stats are core calls, each answered to the worker that asked
        assert replica["hash_agreement"] == "exact", replica
        assert replica["engine"]["num_blocks"] == 128


def test_a_prefix_one_worker_stored_is_served_to_the_other_predicted_exactly(pool: Pool) -> None:
    first, second = pool.workers()
    text = _text(1)
    status, usage, predicted = _chat(pool.connect(first), text)
    assert status == 200 and usage["prompt_tokens_details"]["cached_tokens"] == 0 == predicted
    full = (usage["prompt_tokens"] - 1) // BLOCK * BLOCK
    # the second worker's index holds the blocks the first worker's request stored: they
    # came through the core's KV events (the lookup waits for those on the wire)
    conn = pool.connect(second)
    _, found = _post(
        conn, "/v1/cache/lookup", {"model": "vcache-demo", "messages": _messages(text)}
    )
    assert found["replicas"][0]["predicted_cached_tokens"] == full
    status, usage, predicted = _chat(conn, text)
    assert status == 200  # one prefix cache behind both workers
    assert usage["prompt_tokens_details"]["cached_tokens"] == full == predicted
    # a follow-up sharing all but its last block, back on the first worker
    status, usage, predicted = _chat(pool.connect(first), text + " and one more question")
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert status == 200 and full - BLOCK <= cached == predicted


def test_a_lost_worker_leaves_the_other_serving(pool: Pool) -> None:
    lost, survivor = pool.workers()
    lost.send_signal(signal.SIGKILL)
    lost.wait(10)
    wait_for(lambda: len(pool.workers()) == 1, timeout_s=10)
    for i in range(6):  # new connections all land on the survivor
        status, _, _ = _chat(pool.connect(survivor), _text(100 + i, 50))
        assert status == 200


def test_a_lost_core_restarts_the_set(pool: Pool) -> None:
    (survivor,) = pool.workers()  # the test above lost the other
    (core,) = pool.cores()
    core.send_signal(signal.SIGKILL)
    # the parent stops the survivor and starts the core and both workers again
    wait_for(lambda: _gone(survivor), timeout_s=30)
    try:
        _await_ready(pool, timeout_s=180)
    except pytest.fail.Exception:
        for worker in pool.workers():  # their stacks, into the log (gateway/cli.py)
            worker.send_signal(signal.SIGUSR1)
        time.sleep(2)
        warnings.warn(f"the restarted pool's log:\n{_log_tail(pool.log, 12000)}", stacklevel=1)
        raise
    assert len(pool.cores()) == 1 and core.pid not in [c.pid for c in pool.cores()]
    status, usage, predicted = _chat(pool.connect(pool.workers()[0]), _text(1))
    assert status == 200  # the restarted core's cache is empty: nothing predicted
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0 == predicted
