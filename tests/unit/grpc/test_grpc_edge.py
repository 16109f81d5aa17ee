"""The gRPC edge over an in-memory engine: status codes and error details."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fastapi.testclient import TestClient
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.core.config import ApiKeyConfig, hash_api_key
from gateway.grpc.api import gateway_pb2 as pb
from gateway.grpc.api import gateway_pb2_grpc as pb_grpc
from tests.settings import gateway_settings

KEY = "sk-grpc-admin"
USER = "sk-grpc-user"


@pytest.fixture(scope="module")
def channel(demo_model: Path) -> Iterator[grpc.Channel]:
    engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)), max_model_len=512)
    keys = [
        ApiKeyConfig(sha256=hash_api_key(KEY), tenant="a", name="admin", admin=True),
        ApiKeyConfig(sha256=hash_api_key(USER), tenant="u", name="user"),
    ]
    app = create_app(gateway_settings(api_keys=keys, grpc_port=0), [engine])
    with TestClient(app), grpc.insecure_channel(f"127.0.0.1:{app.state.grpc.port}") as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.GatewayStub:
    return pb_grpc.GatewayStub(channel)


AUTH = (("authorization", f"Bearer {KEY}"),)


def chat_request(**sampling: object) -> pb.ChatCompletionRequest:
    return pb.ChatCompletionRequest(
        model="vcache-demo",
        messages=[pb.ChatMessage(role="user", content="hello")],
        sampling=pb.SamplingParams(**sampling),  # type: ignore[arg-type]
    )


def details(err: grpc.RpcError) -> dict[str, object]:
    status = rpc_status.from_call(err)
    assert status is not None
    out: dict[str, object] = {}
    for d in status.details:
        for kind in (
            error_details_pb2.ErrorInfo,
            error_details_pb2.BadRequest,
            error_details_pb2.RetryInfo,
        ):
            if d.Is(kind.DESCRIPTOR):
                msg = kind()
                d.Unpack(msg)
                out[kind.__name__] = msg
    return out


def test_unary_and_streamed_chat(stub: pb_grpc.GatewayStub) -> None:
    r = stub.ChatCompletion(chat_request(max_tokens=4), metadata=AUTH)
    assert r.finish_reason == "length" and r.usage.completion_tokens == 4
    assert r.usage.replica == "replica-0" and r.usage.target == "local"
    events = list(stub.ChatCompletionStream(chat_request(max_tokens=3), metadata=AUTH))
    assert [e.WhichOneof("event") for e in events][-1] == "end"
    assert events[-1].end.usage.completion_tokens == 3
    assert "".join(e.delta for e in events[:-1])


def test_invalid_argument_names_the_field(stub: pb_grpc.GatewayStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.ChatCompletion(chat_request(temperature=5.0), metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    d = details(err.value)
    bad = d["BadRequest"]
    assert isinstance(bad, error_details_pb2.BadRequest)
    assert bad.field_violations[0].field == "temperature"


def test_missing_key_and_admin_only_cache(stub: pb_grpc.GatewayStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.ListModels(pb.ListModelsRequest())
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as err:
        stub.Stats(pb.StatsRequest(), metadata=(("authorization", f"Bearer {USER}"),))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as err:  # the fake engine has no KV tracking
        stub.Stats(pb.StatsRequest(), metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    retry = details(err.value)["RetryInfo"]
    assert isinstance(retry, error_details_pb2.RetryInfo) and retry.retry_delay.seconds == 5


def test_unknown_model_is_not_found(stub: pb_grpc.GatewayStub) -> None:
    req = chat_request(max_tokens=1)
    req.model = "nope"
    with pytest.raises(grpc.RpcError) as err:
        stub.ChatCompletion(req, metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    info = details(err.value)["ErrorInfo"]
    assert isinstance(info, error_details_pb2.ErrorInfo) and info.reason == "MODEL_NOT_FOUND"


def test_models_and_completion(stub: pb_grpc.GatewayStub) -> None:
    assert [m.id for m in stub.ListModels(pb.ListModelsRequest(), metadata=AUTH).models] == [
        "vcache-demo"
    ]
    r = stub.Completion(
        pb.CompletionRequest(
            model="vcache-demo",
            token_ids=pb.TokenIds(ids=[5, 6, 7]),
            sampling=pb.SamplingParams(max_tokens=2),
        ),
        metadata=AUTH,
    )
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 2


@pytest.mark.parametrize(
    ("method", "stream"),
    [("ChatCompletion", False), ("ChatCompletionStream", True), ("Lookup", False)],
)
def test_bytes_that_are_not_a_message_are_invalid_argument(
    channel: grpc.Channel, method: str, stream: bool
) -> None:
    path = f"/vcache.v1.Gateway/{method}"
    garbage = b"\xff\xff\xff\xff"
    with pytest.raises(grpc.RpcError) as info:
        if stream:
            list(channel.unary_stream(path)(garbage, metadata=AUTH, timeout=10))
        else:
            channel.unary_unary(path)(garbage, metadata=AUTH, timeout=10)
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("The request is not a valid vcache.v1.")
    d = details(err)
    info_ = d["ErrorInfo"]
    assert isinstance(info_, error_details_pb2.ErrorInfo)
    assert info_.reason == "MALFORMED_REQUEST"
    bad = d["BadRequest"]
    assert isinstance(bad, error_details_pb2.BadRequest)
    assert [v.field for v in bad.field_violations] == ["request"]
