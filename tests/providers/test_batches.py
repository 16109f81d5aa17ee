"""The gateway's batch APIs on hosted targets, driven by the official SDKs, against the
provider emulator: OpenAI's ``files.create`` + ``batches.create`` + polling +
``files.content`` and Anthropic's ``messages.batches.create`` + ``results``, on each
provider the emulator serves.  Every item is answered, matched by ``custom_id``, and
every request the gateway sent for it rebuilds from the session log to the bytes sent."""

from __future__ import annotations

import hashlib
import io
import json
import time
from typing import Any

import anthropic
import openai
import pytest

from tests.providers.conftest import KEY, MANUAL, MODELS, Gw

ITEMS = 6


def _rebuilt(gw: Gw, target: str) -> int:
    """How many requests were sent to ``target``; each rebuilds from the log to the bytes
    that were sent."""
    log = gw.log()
    rows = [r for r in log.store.requests() if r.target == target]
    for row in rows:
        _, data = log.rebuild(row.session_id, row.seq)
        assert hashlib.sha256(data).hexdigest() == row.sha256, row.request_id
    return len(rows)


def _until(done: Any, what: str, timeout_s: float = 30.0) -> Any:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        out = done()
        if out:
            return out
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen in {timeout_s} s")


@pytest.mark.parametrize("provider", ["openai", "anthropic", "deepseek", "gemini"])
def test_the_openai_batch_api_on_a_hosted_target(gw: Gw, provider: str) -> None:
    target = f"{provider}/{MODELS[provider]}"
    client = gw.client()
    lines = [
        {
            "custom_id": f"item-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": target,
                "max_tokens": 4,
                "messages": [
                    {"role": "system", "content": MANUAL},
                    {"role": "user", "content": f"what is section {i} about?"},
                ],
            },
        }
        for i in range(ITEMS)
    ]
    data = b"".join(json.dumps(ln).encode() + b"\n" for ln in lines)
    f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = _until(
        lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b,
        "the batch's end",
    )
    assert done.request_counts is not None and done.request_counts.completed == ITEMS
    assert done.output_file_id is not None and done.error_file_id is None
    out = [json.loads(x) for x in client.files.content(done.output_file_id).read().splitlines()]
    assert sorted(x["custom_id"] for x in out) == [f"item-{i}" for i in range(ITEMS)]
    for x in out:
        body = x["response"]["body"]
        assert x["response"]["status_code"] == 200 and body["choices"][0]["message"]["content"]
    assert _rebuilt(gw, target) == ITEMS


def test_the_anthropic_message_batches_api_on_a_hosted_target(gw: Gw) -> None:
    target = f"anthropic/{MODELS['anthropic']}"
    client = anthropic.Anthropic(
        base_url="http://testserver", api_key=KEY, http_client=gw.http, max_retries=0
    )
    system: Any = [{"type": "text", "text": MANUAL, "cache_control": {"type": "ephemeral"}}]
    requests: Any = [
        {
            "custom_id": f"m-{i}",
            "params": {
                "model": target,
                "max_tokens": 4,
                "system": system,
                "messages": [{"role": "user", "content": f"what is section {i} about?"}],
            },
        }
        for i in range(ITEMS)
    ]
    batch = client.messages.batches.create(requests=requests)
    _until(
        lambda: client.messages.batches.retrieve(batch.id).processing_status == "ended",
        "the batch's end",
    )
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert sorted(results) == [f"m-{i}" for i in range(ITEMS)]
    assert all(r.type == "succeeded" for r in results.values())
    reads = [r.message.usage.cache_read_input_tokens or 0 for r in results.values()]  # type: ignore[union-attr]
    assert sum(1 for n in reads if n > 0) >= ITEMS - 1  # the lead wrote, its siblings read
    assert _rebuilt(gw, target) == ITEMS


def test_an_openai_batch_on_an_unknown_hosted_model_fails_each_item(gw: Gw) -> None:
    client: openai.OpenAI = gw.client()
    line = {
        "custom_id": "x",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "nowhere/none", "messages": [{"role": "user", "content": "hi"}]},
    }
    f = client.files.create(
        file=("in.jsonl", io.BytesIO(json.dumps(line).encode())), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = _until(
        lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b,
        "the batch's end",
    )
    assert done.request_counts is not None and done.request_counts.failed == 1
    assert done.error_file_id is not None
    [err] = [json.loads(x) for x in client.files.content(done.error_file_id).read().splitlines()]
    assert err["custom_id"] == "x" and err["response"]["status_code"] == 404
