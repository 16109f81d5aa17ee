"""Anthropic's Message Batches API driven by the official ``anthropic`` SDK against the
app over the in-memory engine: create, retrieve, results matched by ``custom_id``, an
item's bad params as its ``errored`` result, cancel, delete, list, and bad input and
another tenant's batch in Anthropic's error format."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest
from anthropic.types.messages import MessageBatch
from fastapi.testclient import TestClient

from engines.fake import FakeEngine, Hold
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.batches.store import ItemRow
from gateway.http.routes.message_batches import result_line
from tests.settings import gateway_settings
from tests.unit.batches.conftest import KEY, MODEL, OTHER, keys


def params(system: str, text: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 3,
        "system": f"Extract the invoice total. Format {system}.",
        "messages": [{"role": "user", "content": text}],
    }


def sdk(http: TestClient, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url="http://testserver", api_key=key, http_client=http, max_retries=0
    )


def ended(client: anthropic.Anthropic, batch_id: str, timeout_s: float = 20.0) -> MessageBatch:
    deadline = time.monotonic() + timeout_s
    while True:
        b = client.messages.batches.retrieve(batch_id)
        if b.processing_status == "ended":
            return b
        assert time.monotonic() < deadline, f"batch {batch_id} still {b.processing_status}"
        time.sleep(0.01)


@pytest.fixture
def gw(tokenizer: ChatTokenizer) -> Iterator[tuple[FakeEngine, TestClient]]:
    engine = FakeEngine(tokenizer, max_model_len=1024)
    with TestClient(
        create_app(gateway_settings(grpc_port=None, api_keys=keys()), [engine])
    ) as http:
        yield engine, http


def test_every_request_is_answered_and_its_result_matched_by_custom_id(
    gw: tuple[FakeEngine, TestClient],
) -> None:
    engine, http = gw
    client = sdk(http)
    requests: list[Any] = [
        {"custom_id": f"inv-{i}", "params": params("A" if i % 3 else "B", f"invoice {i}")}
        for i in range(6)
    ]
    requests.append({"custom_id": "broken", "params": {"model": MODEL, "messages": []}})
    created = client.messages.batches.create(requests=requests)
    assert created.id.startswith("msgbatch_") and created.type == "message_batch"
    assert created.request_counts.processing == 7 and created.results_url is None
    b = ended(client, created.id)
    counts = b.request_counts
    assert (counts.succeeded, counts.errored, counts.processing) == (6, 1, 0)
    assert b.ended_at is not None
    assert b.results_url == f"http://testserver/v1/messages/batches/{b.id}/results"
    vcache = (b.model_extra or {})["vcache"]
    assert vcache["plan"]["units"] == 7 and vcache["usage"]["input_tokens"] > 0
    assert vcache["usage"]["cached_tokens"] > 0  # siblings read their lead's prefix

    results = {r.custom_id: r.result for r in client.messages.batches.results(b.id)}
    assert set(results) == {r["custom_id"] for r in requests}
    for i in range(6):
        r = results[f"inv-{i}"]
        assert r.type == "succeeded"
        assert r.message.content[0].type == "text" and r.message.content[0].text
    broken = results["broken"]
    assert broken.type == "errored"
    assert broken.error.type == "error" and broken.error.error.type == "invalid_request_error"
    assert [r.priority for r in engine.received] == [1] * 6  # the batch priority

    deleted = client.messages.batches.delete(b.id)
    assert (deleted.id, deleted.type) == (b.id, "message_batch_deleted")
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(b.id)


def test_cancel_stops_new_requests_and_keeps_the_finished(tokenizer: ChatTokenizer) -> None:
    hold = Hold(at=0)
    engine = FakeEngine(tokenizer, max_model_len=1024, hold=hold)
    with TestClient(
        create_app(gateway_settings(grpc_port=None, api_keys=keys()), [engine])
    ) as http:
        client = sdk(http)
        requests: list[Any] = [
            {"custom_id": f"r{i}", "params": params("A", f"invoice {i}")} for i in range(4)
        ]
        b = client.messages.batches.create(requests=requests)
        deadline = time.monotonic() + 20
        while not (engine.received and hold.waiting(engine.received[0].request_id)):
            assert time.monotonic() < deadline, "the lead never reached the engine"
            time.sleep(0.01)
        early = http.get(f"/v1/messages/batches/{b.id}/results", headers={"x-api-key": KEY})
        assert early.status_code == 400 and early.headers["request-id"].startswith("req_")
        assert early.json()["error"]["type"] == "invalid_request_error"
        assert "not ended" in early.json()["error"]["message"]
        with pytest.raises(anthropic.BadRequestError):
            client.messages.batches.delete(b.id)  # cancel first
        canceling = client.messages.batches.cancel(b.id)
        assert canceling.processing_status == "canceling"
        assert canceling.cancel_initiated_at is not None
        hold.release()
        done = ended(client, b.id)
        results = {r.custom_id: r.result.type for r in client.messages.batches.results(b.id)}
    assert (done.request_counts.succeeded, done.request_counts.canceled) == (1, 3)
    assert results == {"r0": "succeeded", "r1": "canceled", "r2": "canceled", "r3": "canceled"}
    assert len(engine.received) == 1


def test_list_pages_newest_first(gw: tuple[FakeEngine, TestClient]) -> None:
    _, http = gw
    client = sdk(http)
    one: list[Any] = [{"custom_id": "x", "params": params("A", "x")}]
    ids = [client.messages.batches.create(requests=one).id for _ in range(3)]
    page = client.messages.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    assert page.last_id == ids[1]
    rest = client.messages.batches.list(limit=2, after_id=ids[1])
    assert [b.id for b in rest.data] == [ids[0]] and not rest.has_more
    assert sdk(http, OTHER).messages.batches.list().data == []


def test_bad_input_and_another_tenants_batch_in_anthropics_format(
    gw: tuple[FakeEngine, TestClient],
) -> None:
    (
        _,
        http,
    ) = gw
    client = sdk(http)
    with pytest.raises(anthropic.BadRequestError) as bad_id:
        client.messages.batches.create(
            requests=[{"custom_id": "has space", "params": params("A", "x")}]  # type: ignore[typeddict-item]
        )
    assert "requests.0.custom_id" in bad_id.value.message
    with pytest.raises(anthropic.BadRequestError) as dup:
        client.messages.batches.create(
            requests=[
                {"custom_id": "same", "params": params("A", "x")},  # type: ignore[typeddict-item]
                {"custom_id": "same", "params": params("A", "y")},  # type: ignore[typeddict-item]
            ]
        )
    assert "requests.1.custom_id" in dup.value.message
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.create(requests=[])

    one: list[Any] = [{"custom_id": "x", "params": params("A", "x")}]
    b = client.messages.batches.create(requests=one)
    other = sdk(http, OTHER)
    with pytest.raises(anthropic.NotFoundError) as missing:
        other.messages.batches.retrieve(b.id)
    assert missing.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": f"No such message batch: {b.id}"},
        "request_id": missing.value.response.headers["request-id"],
    }
    with pytest.raises(anthropic.NotFoundError):
        other.messages.batches.cancel(b.id)
    with pytest.raises(anthropic.NotFoundError):
        other.messages.batches.delete(b.id)
    raw = http.get(f"/v1/messages/batches/{b.id}/results", headers={"x-api-key": OTHER})
    assert raw.status_code == 404 and raw.json()["error"]["type"] == "not_found_error"


def test_each_items_result_line_is_in_anthropics_shape() -> None:
    def item(state: Any, **kw: Any) -> ItemRow:
        return ItemRow(0, "c", "{}", state, **kw)

    msg = {"id": "msg_1", "type": "message", "content": []}
    assert result_line(item("done", status_code=200, result={"body": msg})) == {
        "custom_id": "c",
        "result": {"type": "succeeded", "message": msg},
    }
    overloaded = {"status": 503, "type": "service_unavailable", "message": "queue full"}
    errored = result_line(
        item("error", status_code=503, result={"error": overloaded, "request_id": "req_9"})
    )
    assert errored == {
        "custom_id": "c",
        "result": {
            "type": "errored",
            "error": {
                "type": "error",
                "error": {"type": "overloaded_error", "message": "queue full"},
                "request_id": "req_9",
            },
        },
    }
    bad = {"status": 400, "type": "invalid_request_error", "message": "max_tokens: required"}
    assert result_line(item("error", status_code=400, result={"error": bad}))["result"]["error"][
        "error"
    ] == {"type": "invalid_request_error", "message": "max_tokens: required"}
    assert result_line(item("canceled")) == {"custom_id": "c", "result": {"type": "canceled"}}
    assert result_line(item("expired")) == {"custom_id": "c", "result": {"type": "expired"}}
