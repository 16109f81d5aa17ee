"""The emulator's batch APIs through the official SDKs: OpenAI's Files and Batch APIs
(``files.create``, ``batches.create``, polling, ``files.content``) and Anthropic's
Message Batches (``messages.batches.create``, ``retrieve``, ``results``), their errors,
their cancel, and their best-effort caching inside a batch (a wave of items does not
read its own writes; a later wave reads the prefix an earlier one wrote)."""

from __future__ import annotations

import io
import json
from typing import Any

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from tests.providers.conftest import MANUAL, MODELS, PROVIDER_KEY, Emulator


@pytest.fixture
def emu(emulator: Emulator) -> Emulator:
    emulator.admin("reset")
    emulator.admin("batch-rules", delay_s=0, parallel=4)
    return emulator


def oai(e: Emulator) -> openai.OpenAI:
    assert isinstance(e.http, TestClient)  # the in-process emulator
    return openai.OpenAI(
        base_url=e.base_url("openai"), api_key=PROVIDER_KEY, http_client=e.http, max_retries=0
    )


def anth(e: Emulator) -> anthropic.Anthropic:
    assert isinstance(e.http, TestClient)
    return anthropic.Anthropic(
        base_url=e.url, api_key=PROVIDER_KEY, http_client=e.http, max_retries=0
    )


def chat_line(i: int, url: str = "/v1/chat/completions") -> dict[str, Any]:
    body = {
        "model": MODELS["openai"],
        "max_tokens": 4,
        "messages": [
            {"role": "system", "content": MANUAL},
            {"role": "user", "content": f"question {i}"},
        ],
    }
    return {"custom_id": f"q-{i}", "method": "POST", "url": url, "body": body}


def upload(client: openai.OpenAI, lines: list[dict[str, Any]]) -> str:
    data = b"".join(json.dumps(ln).encode() + b"\n" for ln in lines)
    return client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id


def jsonl(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in data.splitlines() if ln.strip()]


def test_an_openai_batch_answers_every_item_half_price_and_caches_across_waves(
    emu: Emulator,
) -> None:
    client = oai(emu)
    fid = upload(client, [chat_line(i) for i in range(12)])
    batch = client.batches.create(
        input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "in_progress" and batch.request_counts is not None
    assert batch.request_counts.total == 12 and batch.output_file_id is None
    done = client.batches.retrieve(batch.id)  # polled: its delay has passed
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (12, 0)
    assert done.output_file_id is not None and done.error_file_id is None
    lines = jsonl(client.files.content(done.output_file_id).read())
    assert sorted(ln["custom_id"] for ln in lines) == sorted(f"q-{i}" for i in range(12))
    cached = [
        ln["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for ln in lines
    ]
    assert all(ln["response"]["status_code"] == 200 and ln["error"] is None for ln in lines)
    # the first wave of 4 runs side by side: none reads the others' writes; the rest read
    assert cached[:4] == [0, 0, 0, 0] and all(c >= 1024 for c in cached[4:])
    bill = emu.admin_get("billing")
    assert "openai" not in bill and bill["openai-batch"]["requests"] == 12
    assert bill["openai-batch"]["read"] == sum(cached)
    assert done.usage is not None and done.usage.input_tokens_details.cached_tokens == sum(cached)
    listed = client.batches.list(limit=5)
    assert [b.id for b in listed.data] == [batch.id]


def test_an_openai_batch_with_a_bad_line_fails_naming_it(emu: Emulator) -> None:
    client = oai(emu)
    lines = [chat_line(0), chat_line(1, url="/v1/responses"), chat_line(0)]
    fid = upload(client, lines)
    batch = client.batches.create(
        input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert batch.status == "failed" and batch.errors is not None and batch.errors.data
    codes = [(e.code, e.line) for e in batch.errors.data]
    assert codes == [("mismatched_endpoint", 2), ("duplicate_custom_id", 3)]


def test_openai_batch_wire_errors(emu: Emulator) -> None:
    client = oai(emu)
    fid = upload(client, [chat_line(0)])
    with pytest.raises(openai.BadRequestError) as bad:
        client.batches.create(
            input_file_id=fid,
            endpoint="/v1/chat/completions",
            completion_window="1h",  # type: ignore[arg-type]
        )
    assert bad.value.body["param"] == "completion_window"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-missing", endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="assistants")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_missing")
    batch = client.batches.create(
        input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert client.batches.retrieve(batch.id).status == "completed"
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)
    emu.admin("faults", kind="status", status=429, provider="openai", retry_after="3")
    with pytest.raises(openai.RateLimitError):
        client.batches.create(
            input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h"
        )


def test_a_cancelled_openai_batch_reports_its_items_cancelled(emu: Emulator) -> None:
    emu.admin("batch-rules", delay_s=600, parallel=4)
    client = oai(emu)
    fid = upload(client, [chat_line(i) for i in range(3)])
    batch = client.batches.create(
        input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert client.batches.cancel(batch.id).status == "cancelling"
    ended = client.batches.retrieve(batch.id)
    assert ended.status == "cancelled" and ended.output_file_id is None
    assert ended.error_file_id is not None
    errors = jsonl(client.files.content(ended.error_file_id).read())
    assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [
        (f"q-{i}", "batch_cancelled") for i in range(3)
    ]


def message_params(i: int, **extra: Any) -> Any:
    system = [{"type": "text", "text": MANUAL, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    return {
        "model": MODELS["anthropic"],
        "max_tokens": 4,
        "system": system,
        "messages": [{"role": "user", "content": f"question {i}"}],
        **extra,
    }


def test_an_anthropic_batch_answers_every_item_with_its_breakpoints(emu: Emulator) -> None:
    client = anth(emu)
    requests: list[Any] = [{"custom_id": f"m-{i}", "params": message_params(i)} for i in range(9)]
    requests.append({"custom_id": "bad", "params": {"model": MODELS["anthropic"], "messages": []}})
    batch = client.messages.batches.create(requests=requests)
    assert batch.processing_status == "in_progress" and batch.request_counts.processing == 10
    ended = client.messages.batches.retrieve(batch.id)
    assert ended.processing_status == "ended" and ended.results_url is not None
    counts = ended.request_counts
    assert (counts.succeeded, counts.errored, counts.canceled) == (9, 1, 0)
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert sorted(results) == sorted([*(f"m-{i}" for i in range(9)), "bad"])
    bad = results.pop("bad")
    assert bad.type == "errored" and bad.error.error.type == "invalid_request_error"
    usage = [results[f"m-{i}"].message.usage for i in range(9)]  # type: ignore[union-attr]
    # the first wave writes the 1h breakpoint (each of the 4, side by side), the rest read it
    assert all(u.cache_creation_input_tokens and not u.cache_read_input_tokens for u in usage[:4])
    assert all(u.cache_read_input_tokens and not u.cache_creation_input_tokens for u in usage[4:])
    assert usage[0].cache_creation is not None
    assert usage[0].cache_creation.ephemeral_1h_input_tokens == usage[0].cache_creation_input_tokens
    bill = emu.admin_get("billing")["anthropic-batch"]
    assert bill["requests"] == 9 and bill["write_long"] == 4 * usage[0].cache_creation_input_tokens


def test_anthropic_batch_wire_errors_and_cancel(emu: Emulator) -> None:
    client = anth(emu)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.create(
            requests=[{"custom_id": "no spaces", "params": message_params(0)}]
        )
    twice: Any = [{"custom_id": "a", "params": message_params(0)}] * 2
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.create(requests=twice)
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve("msgbatch_missing")
    emu.admin("batch-rules", delay_s=600, parallel=4)
    batch = client.messages.batches.create(
        requests=[{"custom_id": f"m-{i}", "params": message_params(i)} for i in range(3)]
    )
    with pytest.raises(anthropic.AnthropicError, match="results_url"):
        list(client.messages.batches.results(batch.id))
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.delete(batch.id)
    assert client.messages.batches.cancel(batch.id).processing_status == "canceling"
    ended = client.messages.batches.retrieve(batch.id)
    assert ended.processing_status == "ended" and ended.request_counts.canceled == 3
    kinds = [r.result.type for r in client.messages.batches.results(batch.id)]
    assert kinds == ["canceled"] * 3
    assert client.messages.batches.delete(batch.id).id == batch.id
    assert [b.id for b in client.messages.batches.list()] == []
