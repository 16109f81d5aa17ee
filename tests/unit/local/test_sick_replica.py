"""A replica whose engine core cannot be asked (its control endpoint is down).

Chat requests still route and answer (the replica is predicted from the
events seen so far and marked not exact); the cache API answers 503 with
Retry-After in each edge's error shape (OpenAI's body over HTTP, UNAVAILABLE
with details over gRPC), never a 500.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from engines.errors import EngineUnavailable
from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.core.config import ApiKeyConfig, hash_api_key
from gateway.grpc.api import gateway_pb2 as pb
from gateway.grpc.api import gateway_pb2_grpc as pb_grpc
from gateway.local.replicas import Replica
from gateway.local.spans import KVSpans
from manifest.index import LocationId
from tests.settings import gateway_settings

KEY = "sk-sick-admin"
R = LocationId("replica-0")
AUTH = {"authorization": f"Bearer {KEY}"}


class SickCore:
    """An engine core whose control endpoint refuses every call."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def call_core(self, method: str, *args: Any) -> Any:
        self.calls.append(method)
        raise EngineUnavailable(f"control endpoint unreachable ({method})")

    def generate(self, request: Any) -> Any:
        raise AssertionError("not used")


@pytest.fixture
def sick(demo_model: Path, tmp_path: Path) -> Iterator[tuple[TestClient, SickCore, KVSpans, str]]:
    engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)), block_size=16)
    keys = [ApiKeyConfig(sha256=hash_api_key(KEY), tenant="a", name="admin", admin=True)]
    core = SickCore()
    kv = KVSpans(16, "0", pin_max_share=0.5, default_lease_s=60)
    kv.attach(R, core, f"ipc://{tmp_path}/events", None)
    kv.state(R).agreement = "exact"  # the probe had agreed before the endpoint went down

    async def attach(replicas: Sequence[Replica]) -> KVSpans:
        return kv  # the spans the boot attaches to the replica

    settings = gateway_settings(api_keys=keys, grpc_port=0)
    app = create_app(settings, [engine], attach_spans=attach)
    with TestClient(app) as client:
        yield client, core, kv, f"127.0.0.1:{app.state.grpc.port}"


def _chat(client: TestClient) -> Any:
    body = {
        "model": "vcache-demo",
        "messages": [{"role": "user", "content": "the same long question " * 20}],
        "max_tokens": 2,
    }
    return client.post("/v1/chat/completions", json=body, headers=AUTH)


def test_chat_routes_past_a_sick_control_endpoint(
    sick: tuple[TestClient, SickCore, KVSpans, str],
) -> None:
    client, core, kv, _ = sick
    first = _chat(client)
    assert first.status_code == 200, first.text
    assert first.headers["x-vcache-predicted-cached-tokens"] == "0"  # exact: nothing seen yet
    # the first answer's blocks are not in the index (no events arrive), so the next
    # request's routing asks the engine core for a barrier, which fails
    second = _chat(client)
    assert second.status_code == 200, second.text
    assert core.calls == ["vcache_events_barrier"]
    assert "x-vcache-predicted-cached-tokens" not in second.headers  # no exact claim
    assert kv.state(R).sync_failures == 1 and not kv.is_exact(R)


@pytest.mark.parametrize("op", ["lookup", "pin", "evict", "warm"])
def test_cache_api_answers_503_with_retry_after(
    sick: tuple[TestClient, SickCore, KVSpans, str], op: str
) -> None:
    client, _, _, _ = sick
    body: dict[str, object] = {"model": "vcache-demo", "prompt": "a prompt to name spans by"}
    r = client.post(f"/v1/cache/{op}", json=body, headers=AUTH)
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "5"
    assert r.json() == {
        "error": {
            "message": "control endpoint unreachable (vcache_events_barrier)"
            if op != "evict"
            else "control endpoint unreachable (vcache_evict)",
            "type": "service_unavailable",
            "param": None,
            "code": "engine_unavailable",
        }
    }


def test_grpc_cache_call_is_unavailable_with_details(
    sick: tuple[TestClient, SickCore, KVSpans, str],
) -> None:
    _, _, _, target = sick

    def call() -> grpc.RpcError:
        with grpc.insecure_channel(target) as ch:
            stub = pb_grpc.GatewayStub(ch)
            req = pb.CacheRequest(model="vcache-demo", prompt="a prompt to name spans by")
            try:
                stub.Lookup(req, metadata=(("authorization", f"Bearer {KEY}"),), timeout=10)
            except grpc.RpcError as err:
                return err
        raise AssertionError("Lookup succeeded against a sick replica")

    err = asyncio.run(asyncio.to_thread(call))
    assert err.code() is grpc.StatusCode.UNAVAILABLE
    status = rpc_status.from_call(err)
    assert status is not None
    infos, retry = [], []
    for d in status.details:
        info, delay = error_details_pb2.ErrorInfo(), error_details_pb2.RetryInfo()
        if d.Unpack(info):
            infos.append(info)
        elif d.Unpack(delay):
            retry.append(delay.retry_delay.seconds)
    assert retry == [5]
    assert [i.reason for i in infos] == ["ENGINE_UNAVAILABLE"]  # google.rpc reasons are UPPER_SNAKE
