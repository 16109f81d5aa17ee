"""The gRPC API with the official grpcio client on loopback, over real vLLM CPU replicas."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gateway.grpc.api import gateway_pb2 as pb
from gateway.grpc.api import gateway_pb2_grpc as pb_grpc
from tests.integration.conftest import KEY_A, Gateway, wait_for

pytestmark = pytest.mark.integration

AUTH = (("authorization", f"Bearer {KEY_A}"),)
SYSTEM = "You answer questions about prefix caches, KV blocks and routing. " * 30


@pytest.fixture(scope="module")
def channel(gateway: Gateway) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(gateway.grpc_target) as ch:
        yield ch


@pytest.fixture(scope="module")
def stub(channel: grpc.Channel) -> pb_grpc.GatewayStub:
    return pb_grpc.GatewayStub(channel)


def chat(content: str, system: str | None = None, **sampling: object) -> pb.ChatCompletionRequest:
    messages = [pb.ChatMessage(role="system", content=system)] if system else []
    messages.append(pb.ChatMessage(role="user", content=content))
    return pb.ChatCompletionRequest(
        model="vcache-demo",
        messages=messages,
        sampling=pb.SamplingParams(**sampling),  # type: ignore[arg-type]
    )


def test_health_serving_and_reflection(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "vcache.v1.Gateway"):
        r = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert r.status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = refl.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"vcache.v1.Gateway", "grpc.health.v1.Health"} <= names


def test_unary_chat_and_repeated_prefix_reports_cached_tokens(stub: pb_grpc.GatewayStub) -> None:
    first = stub.ChatCompletion(chat("How are blocks hashed?", SYSTEM, max_tokens=2), metadata=AUTH)
    second = stub.ChatCompletion(chat("What evicts a block?", SYSTEM, max_tokens=2), metadata=AUTH)
    assert first.usage.completion_tokens <= 2 and first.usage.cached_tokens == 0
    print(
        f"\ngRPC repeated prefix: prompt {second.usage.prompt_tokens}, "
        f"cached {second.usage.cached_tokens} on {second.usage.replica}"
    )
    assert second.usage.cached_tokens >= 3 * 128
    assert second.usage.replica == first.usage.replica  # kv routing followed the prefix
    assert second.usage.HasField("predicted_cached_tokens")
    assert second.usage.predicted_cached_tokens == second.usage.cached_tokens
    # one request at a time: its blocks held from routing to scheduling, said exact
    assert (second.usage.prediction, second.usage.prediction_cause) == ("exact", "")


def test_streamed_chat_ends_with_usage(stub: pb_grpc.GatewayStub) -> None:
    events = list(
        stub.ChatCompletionStream(
            chat("stream please", max_tokens=8, ignore_eos=True), metadata=AUTH
        )
    )
    assert all(e.WhichOneof("event") == "delta" for e in events[:-1]) and len(events) > 1
    end = events[-1].end
    assert end.finish_reason == "length" and end.usage.completion_tokens == 8
    assert end.usage.total_tokens == end.usage.prompt_tokens + 8


def test_errors(stub: pb_grpc.GatewayStub) -> None:
    with pytest.raises(grpc.RpcError) as err:
        stub.ChatCompletion(chat("x", temperature=7.0), metadata=AUTH)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in (err.value.details() or "")
    with pytest.raises(grpc.RpcError) as err:
        stub.ChatCompletion(chat("x", max_tokens=1))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def _idle(gateway: Gateway) -> bool:
    m = gateway.metrics()
    return (
        m["vcache_engine_unfinished_requests"] == 0
        and m["vcache_engine_core_running_requests"] == 0
    )


ABORTED = 'vcache_requests_aborted_total{endpoint="chat"}'


def test_short_deadline_is_deadline_exceeded_and_aborts(
    gateway: Gateway, stub: pb_grpc.GatewayStub
) -> None:
    before = gateway.metrics().get(ABORTED, 0)
    with pytest.raises(grpc.RpcError) as err:
        stub.ChatCompletion(
            chat("long answer", max_tokens=1900, ignore_eos=True), metadata=AUTH, timeout=0.5
        )
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: _idle(gateway), timeout_s=30)
    assert gateway.metrics()[ABORTED] - before == 1


def test_cancelled_stream_aborts(gateway: Gateway, stub: pb_grpc.GatewayStub) -> None:
    before = gateway.metrics().get(ABORTED, 0)
    call = stub.ChatCompletionStream(
        chat("keep going", max_tokens=1900, ignore_eos=True), metadata=AUTH
    )
    for i, _ in enumerate(call):
        if i == 5:
            break
    call.cancel()
    wait_for(lambda: _idle(gateway), timeout_s=30)
    assert gateway.metrics()[ABORTED] - before == 1


def test_cache_lookup_and_stats(stub: pb_grpc.GatewayStub) -> None:
    messages = [
        pb.ChatMessage(role="system", content=SYSTEM),
        pb.ChatMessage(role="user", content="What evicts a block?"),
    ]
    req = pb.CacheRequest(model="vcache-demo", messages=pb.ChatMessages(messages=messages))
    r = stub.Lookup(req, metadata=AUTH)
    assert r.block_size == 128 and len(r.replicas) == 2
    assert max(s.predicted_cached_tokens for s in r.replicas) >= 3 * 128
    stats = stub.Stats(pb.StatsRequest(), metadata=AUTH).stats
    assert set(stats["replicas"].keys()) == {"replica-0", "replica-1"}
    assert stats["replicas"]["replica-0"]["hash_agreement"] == "exact"


def test_cache_warm_pin_unpin_evict(stub: pb_grpc.GatewayStub) -> None:
    req = pb.CacheRequest(model="vcache-demo", prompt="gRPC cache operations on a warm span " * 50)
    warm = stub.Warm(req, metadata=AUTH)
    assert warm.cached_tokens_before == 0 and warm.cached_tokens_after >= 2 * 128
    on = pb.CacheRequest()
    on.CopyFrom(req)
    on.replica = warm.replica
    on.lease_s = 120
    pinned = stub.Pin(on, metadata=AUTH)
    assert pinned.owner == "a" and pinned.lease_s == 120
    assert len(pinned.replicas[0].pinned) == warm.cached_tokens_after // 128
    busy = stub.Evict(on, metadata=AUTH).replicas[0]
    assert list(busy.busy) == list(pinned.replicas[0].pinned) and not busy.evicted  # pins hold
    assert list(stub.Unpin(on, metadata=AUTH).replicas[0].unpinned) == list(
        pinned.replicas[0].pinned
    )
    evicted = stub.Evict(on, metadata=AUTH).replicas[0]
    assert len(evicted.evicted) == len(pinned.replicas[0].pinned) and not evicted.busy
    looked = stub.Lookup(on, metadata=AUTH).replicas[0]
    assert looked.predicted_cached_tokens == 0
