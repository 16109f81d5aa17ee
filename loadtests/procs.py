"""Processes the benchmarks and load tests start: free ports, readiness, clean stops."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def get_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@contextmanager
def serving(
    cmd: list[str],
    ready: Callable[[], bool],
    log_path: Path,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    timeout_s: float = 300,
    stop: signal.Signals = signal.SIGTERM,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``cmd`` until the block ends, once ``ready()`` holds; stopped with ``stop``
    (killed if it has not exited a minute later)."""
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{' '.join(cmd[:4])} did not start; see {log_path}")
            time.sleep(0.5)
        yield proc
    finally:
        proc.send_signal(stop)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_locust(
    workload_json: Path,
    host: str,
    wdir: Path,
    env: dict[str, str],
    users: int,
    limit_s: int,
    user_class: str = "ChatUser",
    reports: bool = False,
    locustfile: str = "locustfile.py",
) -> float:
    """Run loadtests/locustfile.py headless on a dumped workload (raw rows to
    ``wdir/raw.csv``; with ``reports``, locust's own CSV and HTML there too); returns the
    seconds it ran."""
    import os
    import sys

    here = Path(__file__).resolve().parent
    (wdir / "raw.csv").unlink(missing_ok=True)
    run_env = {
        **os.environ,
        "PYTHONPATH": str(here.parent),  # the locust files import the loadtests package
        **env,
        "VCACHE_WORKLOAD": str(workload_json),
        "VCACHE_RAW_CSV": str(wdir / "raw.csv"),
    }
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(here / locustfile),
        *user_class.split(),
        "--headless",
        "-u",
        str(users),
        "-r",
        str(users),
        "-t",
        f"{limit_s}s",
        "--host",
        host,
        "--only-summary",
        "--loglevel",
        "WARNING",
    ]
    if reports:
        cmd += ["--csv", str(wdir / "locust"), "--html", str(wdir / "locust.html")]
    t0 = time.monotonic()
    subprocess.run(cmd, env=run_env, check=False, stdout=subprocess.DEVNULL)
    return time.monotonic() - t0


@contextmanager
def vllm_router(
    out: Path, router: str, model: str, kv_bytes: int, max_model_len: int, extra: list[str]
) -> Iterator[str]:
    """vllm-router's ``cache_aware`` policy over two plain vLLM OpenAI servers of ``model``
    with the same KV size (``extra``: more server flags); yields the router's URL."""
    import os
    import sys

    ports = [free_port(), free_port()]
    router_port = free_port()
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    servers = [
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            model,
            "--served-model-name",
            "vcache-demo",
            "--port",
            str(p),
            "--max-model-len",
            str(max_model_len),
            "--kv-cache-memory-bytes",
            str(kv_bytes),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            *extra,
        ]
        for p in ports
    ]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    cmd = [router, "--port", str(router_port), "--policy", "cache_aware", "--worker-urls", *urls]
    host = f"http://127.0.0.1:{router_port}"
    with (
        serving(servers[0], lambda: get_ok(f"{urls[0]}/v1/models"), out / "vllm-0.log", env),
        serving(servers[1], lambda: get_ok(f"{urls[1]}/v1/models"), out / "vllm-1.log", env),
        serving(cmd, lambda: get_ok(f"{host}/v1/models"), out / "router.log", env),
    ):
        yield host
