"""One real gateway per test session: `vcache serve` on the demo model, vLLM CPU engine.

The gateway runs as a subprocess exactly as a user starts it; tests talk to it
over loopback with the official ``openai`` SDK and plain httpx.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.core.config import Settings, hash_api_key
from loadtests.report import parse_metrics
from tests.settings import gateway_settings

KEY_A = "sk-test-tenant-a"
KEY_B = "sk-test-tenant-b"
# The key of a test's own gateway that uses the admin API or headers: an admin over every
# tenant whose own tenant is "default", the tenant of a caller without a key (who is never
# an admin).  ADMIN_KEYS is the setting that configures it, ADMIN the header that sends it.
ADMIN_KEY = "sk-test-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
ADMIN_KEYS = {
    "VCACHE_API_KEYS": json.dumps(
        [{"sha256": hash_api_key(ADMIN_KEY), "name": "admin", "admin": True, "scope": "global"}]
    )
}
MAX_QUEUED = 3
REPLICAS = 2
ENGINE_NICE = 5  # the shared gateway's engine.nice
KV_CACHE_BYTES = 32 << 20  # per replica: 128 blocks of 128 tokens with the demo model
BODY_LIMIT = 256 * 1024
STARTUP_TIMEOUT_S = 300


def embedded_settings(data_dir: Path) -> Settings:
    """A gateway in the test's own process with one embedded CPU vLLM replica on the
    demo model (built once for the test run, in ``data_dir``)."""
    engine = {
        "replicas": 1,
        "kv_cache_bytes": KV_CACHE_BYTES,
        "max_model_len": 2048,
        "enforce_eager": True,
    }
    return gateway_settings(data_dir=data_dir, engine=engine)


@dataclass(frozen=True)
class Gateway:
    base_url: str
    grpc_target: str
    model: str
    log_path: Path
    sessions_db: Path
    pid: int  # the gateway process

    def client(self, key: str = KEY_A, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=key, max_retries=0, **kwargs)  # type: ignore[arg-type]

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.base_url}/metrics", timeout=10).text)


@pytest.fixture
def closing() -> Iterator[contextlib.ExitStack]:
    """What a test opens (an SDK client, an HTTP client or connection), entered here to be
    closed when the test ends: ``sdk = closing.enter_context(anthropic.Anthropic(...))``.
    A module's fixture object keeps its own stack, closed when the module's gateway stops."""
    with contextlib.ExitStack() as stack:
        yield stack


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def gateway(
    data_dir: Path, demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    port = _free_port()
    grpc_port = _free_port()
    log_path = tmp_path_factory.mktemp("gateway") / "gateway.log"
    keys = [
        {"sha256": hash_api_key(KEY_A), "tenant": "a", "name": "a", "admin": True},
        {"sha256": hash_api_key(KEY_B), "tenant": "b", "name": "b"},
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCACHE_")}
    env["VCACHE_API_KEYS"] = json.dumps(keys)
    sessions = tmp_path_factory.mktemp("sessions") / "sessions.db"
    env["VCACHE_SESSION_LOG__PATH"] = str(sessions)
    env["VCACHE_SESSION_LOG__VERIFY_RECONSTRUCTION"] = "true"
    # the engines below the gateway and the tests' clients on these shared cores
    # (engine.nice; tests/integration/test_placement.py reads it back)
    env["VCACHE_ENGINE__NICE"] = str(ENGINE_NICE)
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
        str(KV_CACHE_BYTES),
        "--replicas",
        str(REPLICAS),
        "--max-model-len",
        "2048",
        "--max-queued-requests",
        str(MAX_QUEUED),
        "--max-request-body-bytes",
        str(BODY_LIMIT),
        "--enforce-eager",
    ]
    base_url = f"http://127.0.0.1:{port}"
    with running(cmd, env, f"{base_url}/readyz", log_path, "gateway") as proc:
        yield Gateway(
            base_url=base_url,
            grpc_target=f"127.0.0.1:{grpc_port}",
            model="vcache-demo",
            log_path=log_path,
            sessions_db=sessions,
            pid=proc.pid,
        )
    # whatever ran and in whatever order: every request the session sent rebuilds
    rebuilt, failed = rebuild_all(sessions, demo_model)
    print(f"\nsession log: {rebuilt} requests rebuilt byte for byte")
    if failed:
        pytest.fail(f"requests that do not rebuild from the session log: {failed}")


SECRET = "s3cret-control"  # the remote replica's control endpoint


@dataclass(frozen=True)
class RemoteVllm:
    """vLLM's own OpenAI server with the vcache plugins: a remote replica."""

    url: str
    events: str
    replay: str
    log: Path  # its output, access lines included

    def routes(self, path: str) -> int:
        """How many requests to ``path`` it has answered so far (its access log)."""
        return self.log.read_text(errors="replace").count(f'"POST {path} HTTP')

    def replica(self) -> dict[str, str]:
        """Its entry in a gateway's ``remote_replicas``."""
        return {
            "url": self.url,
            "kv_events": self.events,
            "kv_events_replay": self.replay,
            "control_secret": SECRET,
        }


def remote_vllm_server(
    model: str, served_name: str, tmp: Path, kv_cache_bytes: int, extra: Sequence[str] = ()
) -> tuple[list[str], dict[str, str], RemoteVllm]:
    """vLLM's own OpenAI server as a remote replica (the vcache plugins, exact hashes, KV
    events over IPC under ``tmp``, the generate route): its command, its environment and
    what a gateway is told of it."""
    port = _free_port()
    events, replay = f"ipc://{tmp}/events", f"ipc://{tmp}/replay"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCACHE_")}
    env |= {
        "PYTHONHASHSEED": "0",
        "VLLM_PLUGINS": "vcache,vcache-control",
        "VCACHE_CONTROL_SECRET": SECRET,
    }
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": events,
        "replay_endpoint": replay,
    }
    server = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo",
        "sha256_cbor",
        "--enable-prompt-tokens-details",
        "--kv-events-config",
        json.dumps(kv_events),
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
        "--enforce-eager",
        "--enable-scale-out",  # the token-in/token-out route too (gateways use it on auto)
        *extra,
    ]
    url = f"http://127.0.0.1:{port}"
    return server, env, RemoteVllm(url, events, replay, tmp / "vllm.log")


@pytest.fixture(scope="session")
def remote_vllm(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteVllm]:
    """One remote replica for the session, shared by every gateway that needs one."""
    tmp = tmp_path_factory.mktemp("remote-vllm")
    extra = ["--max-model-len", "2048"]
    server, env, vllm = remote_vllm_server(str(demo_model), "vcache-demo", tmp, 32 << 20, extra)
    with running(server, env, f"{vllm.url}/v1/models", vllm.log, "vllm server"):
        yield vllm


def rebuild_all(sessions_db: Path, model: Path, url: str | None = None) -> tuple[int, list[str]]:
    """Rebuild every request of a session log (a SQLite file, or the PostgreSQL database
    at ``url``) offline (a tokenizer of its own, no gateway): how many rebuilt byte for
    byte, and the ids of those that did not."""
    from engines.providers.specs import adapter_for
    from engines.tokenizer import ChatTokenizer
    from gateway.sessions.log import SessionLog
    from gateway.sessions.reconstruct import Reconstructor
    from gateway.sessions.store import SessionStore

    store = SessionStore(sessions_db, url=url)
    tokenizer = ChatTokenizer.from_pretrained(str(model))
    log = SessionLog(store, Reconstructor(adapter_for, lambda: tokenizer), verify=False)
    failed = []
    rows = store.requests()
    for row in rows:
        event, data = log.rebuild(row.session_id, row.seq)
        if not hashlib.sha256(data).hexdigest() == row.sha256 == event.sha256:
            failed.append(row.request_id)
    store.close()
    return len(rows) - len(failed), failed


def _log_tail(path: Path, chars: int = 6000) -> str:
    """A process's log without its access-log lines (a readiness poll writes one a try)."""
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if '"GET /' not in ln]
    return "\n".join(lines)[-chars:]


@contextlib.contextmanager
def running(
    cmd: list[str], env: dict[str, str], ready_url: str, log_path: Path, what: str
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``cmd`` until the block ends; wait until ``ready_url`` answers 200 first."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        last = "no answer"
        while True:
            if proc.poll() is not None:
                pytest.fail(f"{what} exited with {proc.returncode}:\n{_log_tail(log_path)}")
            try:
                r = httpx.get(ready_url, timeout=2)
                if r.status_code == 200:
                    break
                last = f"{r.status_code} {r.text[:500]}"
            except httpx.TransportError as exc:
                last = repr(exc)
            if time.monotonic() > deadline:
                pytest.fail(
                    f"{what} not ready in {STARTUP_TIMEOUT_S}s; its readiness said {last}; "
                    f"its log:\n{_log_tail(log_path)}"
                )
            time.sleep(0.5)
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def own_gateway(
    tmp: Path, data_dir: Path, args: list[str], settings: dict[str, str] | None = None
) -> Iterator[str]:
    """A gateway of a test module's own on the demo model (embedded replicas, the session
    log under ``tmp``), started with ``args`` and ``settings`` (``VCACHE_*`` variables)
    beside the defaults; yields its base URL."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("VCACHE_")}
    env.update(settings or {})
    env["VCACHE_SESSION_LOG__PATH"] = str(tmp / "sessions.db")
    env["VCACHE_SESSION_LOG__VERIFY_RECONSTRUCTION"] = "true"
    cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--port",
        str(port),
        "--grpc-port",
        "0",
        "--data-dir",
        str(data_dir),
        "--enforce-eager",
        *args,
    ]
    url = f"http://127.0.0.1:{port}"
    with running(cmd, env, f"{url}/readyz", tmp / "gateway.log", "gateway"):
        yield url


def metric(base_url: str, name: str) -> float:
    """One series of a gateway's ``/metrics`` (``name`` with its labels); 0 when absent."""
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def wait_for(cond: object, timeout_s: float = 30.0, interval_s: float = 0.1) -> None:
    """Poll ``cond()`` until true; fail with a clear message at the deadline."""
    assert callable(cond)
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout_s}s")
        time.sleep(interval_s)


def check_vllm_sampling(base_url: str, model: str, headers: dict[str, str]) -> None:
    """vLLM's sampling extensions steer the engine behind ``base_url`` (embedded or a
    remote replica): allowed_token_ids, a logit bias, stop_token_ids, min_tokens."""
    with httpx.Client(base_url=base_url, headers=headers, timeout=120) as c:
        ids = c.post("/tokenize", json={"model": model, "prompt": "apple orange"}).json()
        t, u = ids["tokens"][0], ids["tokens"][-1]
        assert t != u

        def complete(**extra: object) -> dict[str, Any]:
            body = {"model": model, "prompt": "probe 5", "max_tokens": 6, "temperature": 0}
            r = c.post("/v1/completions", json={**body, **extra})
            assert r.status_code == 200, r.text
            return dict(r.json())

        only = complete(allowed_token_ids=[u])  # nothing else may be sampled
        want = c.post("/detokenize", json={"model": model, "tokens": [u] * 6}).json()
        assert only["choices"][0]["text"] == want["prompt"]
        # t is the only stop token, and a +100 bias makes it the greedy pick every step
        favoured = {"allowed_token_ids": [t, u], "logit_bias": {str(t): 100}}
        stopped = complete(**favoured, stop_token_ids=[t])
        assert stopped["usage"]["completion_tokens"] == 1
        assert stopped["choices"][0]["finish_reason"] == "stop"
        held = complete(**favoured, stop_token_ids=[t], min_tokens=3)  # no stop before 3
        assert held["usage"]["completion_tokens"] == 4
        assert held["choices"][0]["finish_reason"] == "stop"


def check_vllm_logprobs(base_url: str, model: str, headers: dict[str, str]) -> None:
    """vLLM's logprob fields from the engine behind ``base_url``: the prompt's logprobs
    (the first token has none), echo with logprobs scoring a prompt (``max_tokens: 0``)
    and logprob tokens written as token ids."""
    with httpx.Client(base_url=base_url, headers=headers, timeout=120) as c:
        prompt = "the quick brown fox jumps"
        ids = c.post("/tokenize", json={"model": model, "prompt": prompt}).json()["tokens"]
        base = {"model": model, "prompt": prompt, "temperature": 0}
        r = c.post("/v1/completions", json={**base, "max_tokens": 2, "prompt_logprobs": 1})
        assert r.status_code == 200, r.text
        steps = r.json()["choices"][0]["prompt_logprobs"]
        assert len(steps) == len(ids) and steps[0] is None
        for t, step in zip(ids[1:], steps[1:], strict=True):
            assert str(t) in step and step[str(t)]["logprob"] <= 0
            assert any(e["rank"] == 1 for e in step.values())
        scored = c.post(
            "/v1/completions", json={**base, "max_tokens": 0, "echo": True, "logprobs": 0}
        )
        assert scored.status_code == 200, scored.text
        choice = scored.json()["choices"][0]
        assert choice["text"] == prompt
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == [
            steps[i][str(ids[i])]["logprob"] for i in range(1, len(ids))
        ]
        as_ids = {"max_tokens": 3, "logprobs": 1, "return_tokens_as_token_ids": True}
        r = c.post("/v1/completions", json={**base, **as_ids, "return_token_ids": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
