"""OpenAI's Files and Batch APIs driven by the official ``openai`` SDK against the app
over the in-memory engine: every item answered and matched by ``custom_id``, sent at
the batch priority in the DAG's order (an instruction set's lead first), journaled;
the completions and Responses endpoints; cancel; a restart that resumes a half-done
batch; bad input and another tenant's objects in OpenAI's error format."""

from __future__ import annotations

import gc
import json
import sqlite3
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Final, Literal

import openai
import pytest
from fastapi.testclient import TestClient
from openai.types import Batch

from engines.fake import FakeEngine, Hold
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.batches.send import usage_of
from gateway.batches.store import BatchStore, BatchUsage, NewItem
from gateway.core.config import Settings
from tests.settings import gateway_settings
from tests.unit.batches.conftest import KEY, MODEL, OTHER, keys

CHAT: Final = "/v1/chat/completions"
Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/responses"]
ENDED = ("completed", "cancelled", "expired", "failed")


def chat_body(system: str, text: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 3,
        "messages": [
            {"role": "system", "content": f"Label the sentiment of each review. Rules {system}."},
            {"role": "user", "content": text},
        ],
    }


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def line(cid: str, body: dict[str, Any], url: str = CHAT) -> dict[str, Any]:
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


ARRIVAL = [("A", "a1"), ("B", "b1"), ("A", "a2"), ("B", "b2"), ("A", "a3"), ("B", "b3")]


def sdk(http: TestClient, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0
    )


def settled(client: openai.OpenAI, batch_id: str, timeout_s: float = 20.0) -> Batch:
    """Poll as a client does until the batch has ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in ENDED:
            return b
        assert time.monotonic() < deadline, f"batch {batch_id} still {b.status}"
        time.sleep(0.01)


def settings() -> Settings:
    return gateway_settings(grpc_port=None, api_keys=keys())


@pytest.fixture
def gw(tokenizer: ChatTokenizer) -> Iterator[tuple[FakeEngine, TestClient, Settings]]:
    engine = FakeEngine(tokenizer, max_model_len=1024)
    cfg = settings()
    with TestClient(create_app(cfg, [engine])) as http:
        yield engine, http, cfg


def _prompt_tag(engine: FakeEngine, tokenizer: ChatTokenizer, i: int) -> str:
    text = tokenizer.decode(list(engine.received[i].prompt_token_ids))
    tags = [t for _, t in ARRIVAL if t in text]
    assert len(tags) == 1, text
    return tags[0]


def test_every_item_is_answered_in_dag_order_and_matched_by_custom_id(
    gw: tuple[FakeEngine, TestClient, Settings], tokenizer: ChatTokenizer
) -> None:
    engine, http, cfg = gw
    client = sdk(http)
    upload = jsonl([line(tag, chat_body(s, tag)) for s, tag in ARRIVAL])
    f = client.files.create(file=("reviews.jsonl", upload), purpose="batch")
    assert (f.purpose, f.bytes, f.filename) == ("batch", len(upload), "reviews.jsonl")
    assert client.files.content(f.id).content == upload
    created = client.batches.create(
        input_file_id=f.id, endpoint=CHAT, completion_window="24h", metadata={"job": "reviews"}
    )
    assert created.status == "in_progress" and created.metadata == {"job": "reviews"}
    plan = (created.model_extra or {})["vcache"]["plan"]
    assert (plan["units"], plan["prefixes"], plan["anchors"]) == (6, 2, 2)
    assert plan["top7_coverage"] == 1.0

    b = settled(client, created.id)
    assert b.status == "completed" and b.error_file_id is None and b.output_file_id
    assert b.request_counts is not None
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (
        6,
        6,
        0,
    )
    out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    assert sorted(x["custom_id"] for x in out) == sorted(t for _, t in ARRIVAL)
    for x in out:
        assert x["error"] is None and x["response"]["status_code"] == 200
        assert x["response"]["body"]["object"] == "chat.completion"
        assert x["response"]["body"]["choices"][0]["message"]["content"]
    # the batch's usage is its items' (cached tokens included: siblings read their lead's)
    prompt = sum(x["response"]["body"]["usage"]["prompt_tokens"] for x in out)
    cached = sum(
        x["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] for x in out
    )
    assert b.usage is not None
    assert (b.usage.input_tokens, b.usage.input_tokens_details.cached_tokens) == (prompt, cached)
    assert cached > 0

    # sent at the lowest priority, each instruction set's lead before its siblings
    assert [r.priority for r in engine.received] == [1] * 6
    order = [_prompt_tag(engine, tokenizer, i) for i in range(6)]
    assert order.index("a1") < min(order.index("a2"), order.index("a3"))
    assert order.index("b1") < min(order.index("b2"), order.index("b3"))
    assert order[0] == "a1"

    # every item journaled in the session log like any request
    with sqlite3.connect(cfg.session_log.db_path(cfg.data_dir)) as db:
        assert db.execute("SELECT COUNT(*) FROM requests").fetchone()[0] == 6


def test_completions_and_responses_endpoints(gw: tuple[FakeEngine, TestClient, Settings]) -> None:
    _, http, _ = gw
    client = sdk(http)
    cases: list[tuple[Endpoint, dict[str, Any], str]] = [
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "Once upon", "max_tokens": 2},
            "text_completion",
        ),
        ("/v1/responses", {"model": MODEL, "input": "Say hi", "max_output_tokens": 2}, "response"),
    ]
    for url, body, kind in cases:
        f = client.files.create(
            file=("in.jsonl", jsonl([line("x", body, url), line("y", body, url)])), purpose="batch"
        )
        b = settled(
            client,
            client.batches.create(input_file_id=f.id, endpoint=url, completion_window="24h").id,
        )
        assert b.status == "completed" and b.output_file_id
        out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
        assert [x["custom_id"] for x in out] == ["x", "y"]
        assert {x["response"]["body"]["object"] for x in out} == {kind}


def test_an_invalid_item_body_is_that_items_error_line(
    gw: tuple[FakeEngine, TestClient, Settings],
) -> None:
    _, http, _ = gw
    client = sdk(http)
    bad = {"model": MODEL, "messages": "not a list"}
    f = client.files.create(
        file=("in.jsonl", jsonl([line("ok", chat_body("A", "fine")), line("bad", bad)])),
        purpose="batch",
    )
    b = settled(
        client, client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h").id
    )
    assert b.request_counts is not None and (
        b.request_counts.completed,
        b.request_counts.failed,
    ) == (1, 1)
    assert b.error_file_id is not None
    (err,) = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
    assert err["custom_id"] == "bad" and err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["type"] == "invalid_request_error"
    assert err["response"]["body"]["error"]["param"] == "messages"


def test_cancel_stops_new_items_and_keeps_the_finished(tokenizer: ChatTokenizer) -> None:
    hold = Hold(at=0)
    engine = FakeEngine(tokenizer, max_model_len=1024, hold=hold)
    with TestClient(create_app(settings(), [engine])) as http:
        client = sdk(http)
        f = client.files.create(
            file=("in.jsonl", jsonl([line(t, chat_body(s, t)) for s, t in ARRIVAL])),
            purpose="batch",
        )
        b = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
        deadline = time.monotonic() + 20
        while not (engine.received and hold.waiting(engine.received[0].request_id)):
            assert time.monotonic() < deadline, "the lead never reached the engine"
            time.sleep(0.01)
        cancelling = client.batches.cancel(b.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
        hold.release()
        done = settled(client, b.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    assert done.request_counts is not None and done.request_counts.completed == 1
    assert len(engine.received) == 1  # nothing new after the cancel
    assert done.output_file_id and done.error_file_id


def test_list_pages_newest_first(gw: tuple[FakeEngine, TestClient, Settings]) -> None:
    _, http, _ = gw
    client = sdk(http)
    f = client.files.create(
        file=("in.jsonl", jsonl([line("x", chat_body("A", "x"))])), purpose="batch"
    )
    ids = [
        client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h").id
        for _ in range(3)
    ]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    rest = client.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in rest.data] == [ids[0]] and not rest.has_more
    assert [b.id for b in client.batches.list()] == ids[::-1]  # the SDK's auto-paging
    assert sdk(http, OTHER).batches.list().data == []


def test_a_restarted_gateway_finishes_a_half_done_batch(tokenizer: ChatTokenizer) -> None:
    cfg = settings()
    log = cfg.session_log
    store = BatchStore.beside(log.db_path(cfg.data_dir), log.fsync, log.url)
    items = [NewItem(t, json.dumps(chat_body(s, t))) for s, t in ARRIVAL]
    bid = store.create("openai", "one", "one", CHAT, MODEL, items, window_s=3600).id
    # the gateway before the restart answered a1 and was killed while b1 ran
    assert store.claim(bid, 0, "before", lease_s=60)
    kept = {"request_id": "req-before", "body": {"object": "chat.completion", "kept": True}}
    assert store.finish(bid, 0, "before", True, 200, kept, BatchUsage(20, 0, 3))
    assert store.claim(bid, 1, "before", lease_s=0.001)
    store.close()

    engine = FakeEngine(tokenizer, max_model_len=1024)
    with TestClient(create_app(cfg, [engine])) as http:
        client = sdk(http)
        b = settled(client, bid)
        assert b.output_file_id is not None
        out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    assert b.status == "completed"
    assert len(engine.received) == 5  # a1 was not sent again
    assert [x["custom_id"] for x in out] == [t for _, t in ARRIVAL]  # each once
    assert out[0]["response"]["body"] == kept["body"]


def test_an_uploads_spooled_file_is_closed_when_taken_and_when_refused(
    gw: tuple[FakeEngine, TestClient, Settings],
) -> None:
    """Each part of a multipart upload is a spooled temporary file (on disk past 1 MB):
    the route closes it, whether the upload is taken or refused, rather than leaving
    the file and its disk space to the garbage collector."""
    _, http, _ = gw
    client = sdk(http)
    big = jsonl([line(f"i{i}", chat_body("A", "x" * 2000)) for i in range(600)])
    assert len(big) > 1 << 20  # rolled over to a file on disk
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        taken = client.files.create(file=("in.jsonl", big), purpose="batch")
        with pytest.raises(openai.BadRequestError):
            client.files.create(file=("in.jsonl", big), purpose="fine-tune")
        with pytest.raises(openai.BadRequestError):
            client.files.create(file=("in.jsonl", big + b"{not json\n"), purpose="batch")
        gc.collect()
    assert client.files.content(taken.id).content == big
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert unclosed == []


def test_bad_input_is_refused_in_openais_format(
    gw: tuple[FakeEngine, TestClient, Settings],
) -> None:
    _, http, _ = gw
    client = sdk(http)
    good = line("a", chat_body("A", "x"))
    with pytest.raises(openai.BadRequestError) as bad_line:
        client.files.create(file=("in.jsonl", jsonl([good]) + b"{not json\n"), purpose="batch")
    assert bad_line.value.status_code == 400
    assert "line 2" in bad_line.value.message
    with pytest.raises(openai.BadRequestError) as dup:
        client.files.create(file=("in.jsonl", jsonl([good, good])), purpose="batch")
    assert "line 2" in dup.value.message and "twice" in dup.value.message
    with pytest.raises(openai.BadRequestError) as url:
        client.files.create(
            file=("in.jsonl", jsonl([line("a", {}, "/v1/embeddings")])), purpose="batch"
        )
    assert "line 1" in url.value.message
    with pytest.raises(openai.BadRequestError) as purpose:
        client.files.create(file=("in.jsonl", jsonl([good])), purpose="fine-tune")
    assert isinstance(purpose.value.body, dict) and purpose.value.body["param"] == "purpose"

    f = client.files.create(file=("in.jsonl", jsonl([good])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as endpoint:
        client.batches.create(
            input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h"
        )
    assert isinstance(endpoint.value.body, dict) and endpoint.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError) as mismatch:
        client.batches.create(
            input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
        )
    assert "is for /v1/chat/completions" in mismatch.value.message
    with pytest.raises(openai.BadRequestError) as window:
        client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="1h")  # type: ignore[arg-type]
    assert isinstance(window.value.body, dict) and window.value.body["param"] == "completion_window"

    # another tenant's file and batch do not exist for this caller
    b = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
    other = sdk(http, OTHER)
    for call in (
        lambda: other.batches.retrieve(b.id),
        lambda: other.batches.cancel(b.id),
        lambda: other.files.retrieve(f.id),
        lambda: other.files.content(f.id),
        lambda: other.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            call()
        body = missing.value.body
        assert isinstance(body, dict) and body["type"] == "not_found_error"
    raw = http.get(f"/v1/batches/{b.id}", headers={"authorization": f"Bearer {OTHER}"})
    assert raw.status_code == 404
    assert raw.json() == {
        "error": {
            "message": f"No such Batch object: {b.id}",
            "type": "not_found_error",
            "param": "batch_id",
            "code": None,
        }
    }


def test_items_refused_by_a_full_queue_are_sent_again_not_failed(
    tokenizer: ChatTokenizer,
) -> None:
    # room for one batch request at a time: the siblings' fan-out is refused (503
    # queue_full, Retry-After 1) and each refused item is sent again
    engine = FakeEngine(tokenizer, max_model_len=1024, step_delay_s=0.1)
    cfg = gateway_settings(
        grpc_port=None,
        api_keys=keys(),
        engine={"max_queued_requests": 2, "admission_shares": {"batch": 0.5}},
    )
    with TestClient(create_app(cfg, [engine])) as http:
        client = sdk(http)
        arrival = [("A", f"a{i}") for i in range(4)]
        f = client.files.create(
            file=("in.jsonl", jsonl([line(t, chat_body(s, t)) for s, t in arrival])),
            purpose="batch",
        )
        b = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
        done = settled(client, b.id, timeout_s=60)
        shed = http.get("/metrics").text
    assert done.status == "completed" and done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (4, 0)
    assert len(engine.received) == 4  # a refused request never reached the engine
    refused = [
        float(x.split()[-1])
        for x in shed.splitlines()
        if x.startswith('vcache_requests_shed_total{priority="batch"}')
    ]
    assert refused and refused[0] >= 1  # the queue did refuse some, and they were retried


def test_one_at_a_time_the_engine_sees_exactly_the_dag_order(tokenizer: ChatTokenizer) -> None:
    engine = FakeEngine(tokenizer, max_model_len=1024)
    cfg = gateway_settings(grpc_port=None, api_keys=keys(), batches={"concurrency": 1})
    with TestClient(create_app(cfg, [engine])) as http:
        client = sdk(http)
        f = client.files.create(
            file=("in.jsonl", jsonl([line(t, chat_body(s, t)) for s, t in ARRIVAL])),
            purpose="batch",
        )
        b = client.batches.create(input_file_id=f.id, endpoint=CHAT, completion_window="24h")
        assert settled(client, b.id).status == "completed"
    order = [_prompt_tag(engine, tokenizer, i) for i in range(6)]
    assert order == ["a1", "a2", "a3", "b1", "b2", "b3"]  # depth first, not as they arrived


def responses_body(system: str, text: str) -> dict[str, Any]:
    rules = f"Label the sentiment of each review. Rules {system}."
    return {"model": MODEL, "instructions": rules, "input": text, "max_output_tokens": 3}


@pytest.mark.parametrize(
    ("endpoint", "make", "kind"),
    [(CHAT, chat_body, "chat.completion"), ("/v1/responses", responses_body, "response")],
)
def test_siblings_reach_the_engine_while_their_lead_still_decodes(
    tokenizer: ChatTokenizer,
    endpoint: Endpoint,
    make: Callable[[str, str], dict[str, Any]],
    kind: str,
) -> None:
    hold = Hold(at=1)  # every request waits after its first token
    engine = FakeEngine(tokenizer, max_model_len=1024, hold=hold)
    with TestClient(create_app(settings(), [engine])) as http:
        client = sdk(http)
        arrival = [("A", "a1"), ("A", "a2"), ("A", "a3")]
        f = client.files.create(
            file=("in.jsonl", jsonl([line(t, make(s, t), endpoint) for s, t in arrival])),
            purpose="batch",
        )
        b = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")
        deadline = time.monotonic() + 20
        while len(engine.received) < 3:  # the siblings went at the lead's first token
            assert time.monotonic() < deadline, f"only {len(engine.received)} sent"
            time.sleep(0.01)
        lead = engine.received[0].request_id
        assert hold.waiting(lead)  # the lead has not ended
        hold.release()
        done = settled(client, b.id)
        assert done.output_file_id is not None
        out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
    assert done.status == "completed"
    assert [x["custom_id"] for x in out] == ["a1", "a2", "a3"]
    for x in out:  # the lead, streamed to the gateway, is shaped whole like the others
        assert x["response"]["body"]["object"] == kind
        assert usage_of(x["response"]["body"]).output == 3
    assert all(usage_of(x["response"]["body"]).cached > 0 for x in out[1:])


def test_a_batch_upload_takes_its_own_body_limit(tokenizer: ChatTokenizer) -> None:
    """A batch's input is one body, larger than any request: ``POST /v1/files`` (and
    Anthropic's batch create) take ``batches.max_upload_bytes`` in place of
    ``max_request_body_bytes``, which still bounds every other route."""
    cfg = gateway_settings(
        grpc_port=None,
        api_keys=keys(),
        max_request_body_bytes=4096,
        batches={"max_upload_bytes": 64 << 10},
    )
    lines = [line(f"r{i}", chat_body("A" * 200, f"review {i}")) for i in range(60)]
    upload = jsonl(lines)
    assert 4096 < len(upload) < 64 << 10
    with TestClient(create_app(cfg, [FakeEngine(tokenizer, max_model_len=1024)])) as http:
        client = sdk(http)
        f = client.files.create(file=("big.jsonl", upload), purpose="batch")
        assert f.bytes == len(upload)
        with pytest.raises(openai.APIStatusError) as err:
            client.files.create(file=("huge.jsonl", upload * 5), purpose="batch")
        assert err.value.status_code == 413
        assert "65536 bytes" in str(err.value)
        big_chat = chat_body("A" * 5000, "too long for a request")
        r = http.post(CHAT, json=big_chat, headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 413 and "4096 bytes" in r.text
        params = {
            "model": MODEL,
            "max_tokens": 3,
            "system": "A" * 5000,
            "messages": [{"role": "user", "content": "hi"}],
        }
        batch = {"requests": [{"custom_id": "m", "params": params}]}
        r = http.post("/v1/messages/batches", json=batch, headers={"x-api-key": KEY})
        assert r.status_code == 200 and r.json()["type"] == "message_batch", r.text
