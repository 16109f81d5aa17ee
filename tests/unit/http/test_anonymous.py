"""With no API keys configured every caller is anonymous: served on the inference routes,
never an admin.  Each admin surface (the cache API over HTTP and gRPC, the routing
headers) answers 403 in the API's own error shape, naming how to get admin."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.grpc.api import gateway_pb2 as pb
from gateway.grpc.api import gateway_pb2_grpc as pb_grpc
from gateway.service.auth import ANONYMOUS, KeyRing
from tests.settings import gateway_settings

MODEL = "vcache-demo"
HOW = "configure one with 'admin: true' in api_keys and send it as 'Authorization: Bearer KEY'"
CACHE_ROUTES = [
    ("GET", "/v1/cache/stats"),
    ("GET", "/v1/cache/plan"),
    ("POST", "/v1/cache/lookup"),
    ("POST", "/v1/cache/pin"),
    ("POST", "/v1/cache/unpin"),
    ("POST", "/v1/cache/evict"),
    ("POST", "/v1/cache/warm"),
]


def denied(message: str) -> dict[str, dict[str, str | None]]:
    return {
        "error": {
            "message": message,
            "type": "permission_error",
            "param": None,
            "code": "admin_required",
        }
    }


@pytest.fixture(scope="module")
def app_and_engine(demo_model: Path) -> Iterator[tuple[TestClient, FakeEngine]]:
    engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)), max_model_len=512)
    app = create_app(gateway_settings(grpc_port=0), [engine])  # no api_keys
    with TestClient(app) as client:
        yield client, engine


def test_the_anonymous_principal_is_no_admin() -> None:
    who = KeyRing([]).authenticate(None)
    assert (who.tenant, who.key_name) == ("default", "anonymous")
    assert not who.admin and not who.global_admin
    assert not ANONYMOUS.admin and not ANONYMOUS.global_admin


def test_anonymous_is_served_but_never_admin_over_http(
    app_and_engine: tuple[TestClient, FakeEngine],
) -> None:
    c, _ = app_and_engine
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert c.post("/v1/chat/completions", json=ask).status_code == 200
    for method, path in CACHE_ROUTES:
        body = {"model": MODEL, "prompt": "x"} if method == "POST" else None
        r = c.request(method, path, json=body)
        assert (r.status_code, r.json()) == (
            403,
            denied(f"The cache API needs an admin key: {HOW}"),
        ), path
    for header, value in (("x-vcache-routing", "round_robin"), ("x-vcache-replica", "replica-0")):
        r = c.post("/v1/chat/completions", json=ask, headers={header: value})
        assert (r.status_code, r.json()) == (
            403,
            denied(f"x-vcache-routing and x-vcache-replica need an admin key: {HOW}"),
        ), header


def test_anonymous_is_never_admin_over_grpc(
    app_and_engine: tuple[TestClient, FakeEngine],
) -> None:
    c, _ = app_and_engine
    port = c.app.state.grpc.port  # type: ignore[attr-defined]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.GatewayStub(channel)
        assert stub.ListModels(pb.ListModelsRequest(), timeout=10).models  # served
        with pytest.raises(grpc.RpcError) as err:
            stub.Stats(pb.StatsRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert err.value.details() == f"The cache API needs an admin key: {HOW}"
