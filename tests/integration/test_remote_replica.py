"""A remote replica: vLLM's own OpenAI server with the vcache plugins, behind the gateway."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import (
    ADMIN,
    ADMIN_KEYS,
    SECRET,
    RemoteVllm,
    _free_port,
    check_vllm_logprobs,
    check_vllm_sampling,
    running,
    wait_for,
)

pytestmark = pytest.mark.integration

BLOCK = 128


@dataclass(frozen=True)
class Remote:
    vllm_url: str
    gateway_url: str
    api: str  # the route the gateway sends token ids to
    vllm: RemoteVllm


@pytest.fixture(scope="module", params=["generate", "completions"])
def remote(
    request: pytest.FixtureRequest,
    data_dir: Path,
    remote_vllm: RemoteVllm,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Remote]:
    """A gateway in front of the replica, sending to its generate route (what ``auto``
    picks on a replica started with --enable-scale-out) or its completions route."""
    api = str(request.param)
    tmp = tmp_path_factory.mktemp("remote")
    gw_port = _free_port()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("VCACHE_")}
    replica = remote_vllm.replica() | ({} if api == "generate" else {"api": api})
    gw_env = {**base_env, "VCACHE_REMOTE_REPLICAS": json.dumps([replica]), **ADMIN_KEYS}
    gateway = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--replicas",
        "0",
        "--port",
        str(gw_port),
        "--grpc-port",
        str(_free_port()),
        "--data-dir",
        str(data_dir),
    ]
    gw_url = f"http://127.0.0.1:{gw_port}"
    with running(gateway, gw_env, f"{gw_url}/readyz", tmp / "gateway.log", "gateway"):
        yield Remote(remote_vllm.url, gw_url, api, remote_vllm)


def test_remote_replica_agrees_and_predicts_exactly(remote: Remote) -> None:
    stats = httpx.get(f"{remote.gateway_url}/v1/cache/stats", headers=ADMIN, timeout=30).json()
    assert stats["replicas"]["remote-0"]["hash_agreement"] == "exact"
    text = f"Remote replicas keep their own prefix cache ({remote.api}). "
    system = {"role": "system", "content": text * 40}  # a prompt of this gateway's own
    outcomes = []
    for q in ("first", "second", "third"):
        r = httpx.post(
            f"{remote.gateway_url}/v1/chat/completions",
            json={
                "model": "vcache-demo",
                "max_tokens": 2,
                "messages": [system, {"role": "user", "content": q}],
            },
            headers=ADMIN,
            timeout=60,
        )
        assert r.status_code == 200, r.text
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        outcomes.append((int(r.headers["x-vcache-predicted-cached-tokens"]), cached))
        assert r.headers["x-vcache-replica"] == "remote-0"
    print(f"\nremote replica (predicted, actual): {outcomes}")
    assert all(p == a for p, a in outcomes)
    assert outcomes[0][1] == 0 and outcomes[1][1] >= 3 * BLOCK


def test_token_ids_go_to_the_route_the_gateway_picked(remote: Remote) -> None:
    routes = {"generate": "/inference/v1/generate", "completions": "/v1/completions"}
    before = {api: remote.vllm.routes(path) for api, path in routes.items()}
    for stream in (False, True):
        r = httpx.post(
            f"{remote.gateway_url}/v1/chat/completions",
            json={
                "model": "vcache-demo",
                "max_tokens": 3,
                "stream": stream,
                "messages": [{"role": "user", "content": f"which route, {stream}?"}],
            },
            headers=ADMIN,
            timeout=60,
        )
        assert r.status_code == 200, r.text
    sent = {api: remote.vllm.routes(path) - before[api] for api, path in routes.items()}
    assert sent == {api: 2 if api == remote.api else 0 for api in routes}


def test_vllm_sampling_extensions_reach_the_remote_replica(remote: Remote) -> None:
    check_vllm_sampling(remote.gateway_url, "vcache-demo", ADMIN)
    check_vllm_logprobs(remote.gateway_url, "vcache-demo", ADMIN)


def test_pin_and_unpin_through_the_control_endpoint(remote: Remote) -> None:
    body = {"model": "vcache-demo", "prompt": "pinned on a remote replica " * 60}
    with httpx.Client(base_url=remote.gateway_url, headers=ADMIN, timeout=60) as c:
        warmed = c.post("/v1/cache/warm", json=body).json()
        assert warmed["replica"] == "remote-0" and warmed["cached_tokens_after"] >= 2 * BLOCK
        pinned = c.post("/v1/cache/pin", json=body).json()["replicas"][0]
        assert len(pinned["pinned"]) == warmed["cached_tokens_after"] // BLOCK
        engine = c.get("/v1/cache/stats").json()["replicas"]["remote-0"]["engine"]
        assert engine["pinned_blocks"] == len(pinned["pinned"])
        assert c.post("/v1/cache/unpin", json=body).json()["replicas"][0]["unpinned"]
        assert (
            c.get("/v1/cache/stats").json()["replicas"]["remote-0"]["engine"]["pinned_blocks"] == 0
        )


def test_control_endpoint_needs_the_secret(remote: Remote) -> None:
    url = f"{remote.vllm_url}/vcache/v1/control/vcache_cache_stats"
    assert httpx.post(url, json={"args": []}).status_code == 403
    wrong = httpx.post(url, json={"args": []}, headers={"x-vcache-control-secret": "nope"})
    assert wrong.status_code == 403
    ok = httpx.post(url, json={"args": []}, headers={"x-vcache-control-secret": SECRET})
    assert ok.status_code == 200 and ok.json()["result"]["block_size"] == BLOCK


def _vllm_running(remote: Remote) -> float:
    for line in httpx.get(f"{remote.vllm_url}/metrics").text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vllm:num_requests_running not exported")


def test_disconnect_aborts_on_the_remote_replica(remote: Remote) -> None:
    body = {
        "model": "vcache-demo",
        "stream": True,
        "max_tokens": 1900,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "talk for a long while"}],
    }
    with (
        httpx.Client(headers=ADMIN, timeout=60) as c,
        c.stream("POST", f"{remote.gateway_url}/v1/chat/completions", json=body) as resp,
    ):
        lines = resp.iter_lines()
        for n, _ in enumerate(lines):
            if n > 20:
                break
        assert _vllm_running(remote) == 1
    wait_for(lambda: _vllm_running(remote) == 0, timeout_s=30)
