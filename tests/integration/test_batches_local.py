"""The batch APIs on the local model (the real vLLM CPU engine), driven by the official
SDKs: OpenAI's Files and Batch APIs (``files.create``, ``batches.create``, polling,
``files.content``) and Anthropic's Message Batches (``messages.batches.create``,
``results``).  Every item is answered once and matched by its ``custom_id``; the items
under one instruction set are sent lead first, its siblings after it (send-one-then-fan),
so each sibling reads the instruction set's blocks from vLLM's prefix cache; every item
sent rebuilds byte for byte from the session log."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.integration.conftest import KEY_A, Gateway, rebuild_all

pytestmark = pytest.mark.integration

BLOCK = 128
SIBLINGS = 5  # items per instruction set
DEADLINE_S = 240


def _instructions(topic: str) -> str:
    """~800 demo-model tokens: six whole blocks before the question."""
    return f"You classify {topic} for the operations team. " + (
        f"Read the {topic} text and answer with one label from the manual. " * 30
    )


def _shared(gateway: Gateway, system: str) -> int:
    """What any sibling reads from cache once its lead ran: a request under the same
    instructions with a question none of them begins with, sent after the batch."""
    r = gateway.client(KEY_A).chat.completions.create(
        model=gateway.model,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
        max_tokens=1,
    )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.usage.prompt_tokens_details.cached_tokens or 0


def test_an_openai_batch_on_the_local_model(gateway: Gateway, demo_model: Path) -> None:
    client = gateway.client(KEY_A)
    before, _ = rebuild_all(gateway.sessions_db, demo_model)
    topics = ("invoices", "tickets")
    lines = [
        {
            "custom_id": f"{topic}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": gateway.model,
                "max_tokens": 4,
                "messages": [
                    {"role": "system", "content": _instructions(topic)},
                    {"role": "user", "content": f"{topic} number {i}: the text to label."},
                ],
            },
        }
        for i in range(SIBLINGS)
        for topic in topics  # interleaved: arrival order alternates the instruction sets
    ]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    uploaded = client.files.create(file=("items.jsonl", data), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + DEADLINE_S
    while (batch := client.batches.retrieve(batch.id)).status != "completed":
        assert batch.status not in ("failed", "cancelled", "expired"), batch
        assert time.monotonic() < deadline, f"the batch is still {batch.status}"
        time.sleep(0.5)
    assert batch.request_counts is not None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(lines), 0)
    assert batch.output_file_id is not None and batch.error_file_id is None

    out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    ids = [o["custom_id"] for o in out]
    assert sorted(ids) == sorted(str(line["custom_id"]) for line in lines)  # each once
    usage: dict[str, dict[str, Any]] = {}
    for o in out:
        assert o["error"] is None and o["response"]["status_code"] == 200
        body = o["response"]["body"]
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
        usage[o["custom_id"]] = body["usage"]

    for topic in topics:
        shared = _shared(gateway, _instructions(topic))
        assert shared >= 3 * BLOCK
        cached = sorted(
            usage[f"{topic}-{i}"]["prompt_tokens_details"]["cached_tokens"] for i in range(SIBLINGS)
        )
        print(f"\n{topic}: cached {cached} of a shared {shared}")
        # the lead first, its siblings after: every sibling reads the instruction set
        assert all(c >= shared for c in cached[1:]), cached

    after, failed = rebuild_all(gateway.sessions_db, demo_model)
    assert failed == []
    assert after >= before + len(lines)


def test_an_anthropic_message_batch_on_the_local_model(gateway: Gateway, demo_model: Path) -> None:
    sdk = anthropic.Anthropic(base_url=gateway.base_url, api_key=KEY_A, max_retries=0)
    before, _ = rebuild_all(gateway.sessions_db, demo_model)
    system = _instructions("contracts")
    requests: list[Any] = [
        {
            "custom_id": f"contract-{i}",
            "params": {
                "model": gateway.model,
                "max_tokens": 4,
                "system": system,
                "messages": [{"role": "user", "content": f"contract number {i}: label it."}],
            },
        }
        for i in range(SIBLINGS)
    ]
    created = sdk.messages.batches.create(requests=requests)
    deadline = time.monotonic() + DEADLINE_S
    while (b := sdk.messages.batches.retrieve(created.id)).processing_status != "ended":
        assert time.monotonic() < deadline, f"the batch is still {b.processing_status}"
        time.sleep(0.5)
    assert (b.request_counts.succeeded, b.request_counts.errored) == (SIBLINGS, 0)

    results = {r.custom_id: r.result for r in sdk.messages.batches.results(b.id)}
    assert set(results) == {r["custom_id"] for r in requests}
    reads = []
    for r in results.values():
        assert r.type == "succeeded"
        assert r.message.content[0].type == "text" and r.message.content[0].text
        reads.append(r.message.usage.cache_read_input_tokens or 0)
    shared = _shared(gateway, system)
    assert shared >= 3 * BLOCK
    reads.sort()
    print(f"\ncontracts: cache reads {reads} of a shared {shared}")
    assert all(c >= shared for c in reads[1:]), reads

    after, failed = rebuild_all(gateway.sessions_db, demo_model)
    assert failed == []
    assert after >= before + SIBLINGS
