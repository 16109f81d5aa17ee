"""Per-key limits and request priorities over HTTP, with the official clients: a 429 in
each API's own shape with Retry-After and its rate-limit headers (OpenAI's
``x-ratelimit-*``, Anthropic's ``anthropic-ratelimit-*``), the priority carried to the
engine, and a full queue refusing batch before interactive."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine, Hold
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.core.config import ApiKeyConfig, hash_api_key
from tests.settings import gateway_settings

MODEL = "vcache-demo"
ASK: Any = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(str(demo_model))


def _keys() -> list[ApiKeyConfig]:
    return [
        ApiKeyConfig(sha256=hash_api_key("sk-free"), tenant="t", name="free"),
        ApiKeyConfig(
            sha256=hash_api_key("sk-two"),
            tenant="t",
            name="two",
            limits={"requests_per_minute": 2, "tokens_per_minute": 10_000},
        ),
        ApiKeyConfig(
            sha256=hash_api_key("sk-bulk"),
            tenant="t",
            name="bulk",
            priority="batch",
            max_priority="default",
        ),
    ]


@pytest.fixture
def gw(tokenizer: ChatTokenizer) -> Iterator[tuple[FakeEngine, TestClient]]:
    engine = FakeEngine(tokenizer, block_size=16, max_model_len=1024, max_queued_requests=None)
    cfg = gateway_settings(grpc_port=None, api_keys=_keys(), engine={"max_queued_requests": 4})
    with TestClient(create_app(cfg, [engine])) as http:
        yield engine, http


def _openai(http: TestClient, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0
    )


def test_openai_429_with_retry_after_and_ratelimit_headers(
    gw: tuple[FakeEngine, TestClient],
) -> None:
    _, http = gw
    sdk = _openai(http, "sk-two")
    first = sdk.chat.completions.with_raw_response.create(model=MODEL, messages=ASK, max_tokens=2)
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-ratelimit-limit-tokens"] == "10000"
    sdk.completions.create(model=MODEL, prompt="hello", max_tokens=2)  # completions count too
    with pytest.raises(openai.RateLimitError) as err:
        sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    r = err.value.response
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    body = r.json()["error"]
    assert (body["type"], body["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    # another key of the same tenant is not limited by this one's use
    _openai(http, "sk-free").chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    metrics = http.get("/metrics").text
    assert 'vcache_rate_limited_total{key="two",tenant="t"} 1.0' in metrics


def test_anthropic_429_in_anthropic_shape(gw: tuple[FakeEngine, TestClient]) -> None:
    _, http = gw
    sdk = anthropic.Anthropic(
        base_url="http://testserver", api_key="sk-two", http_client=http, max_retries=0
    )
    ok = sdk.messages.with_raw_response.create(model=MODEL, max_tokens=2, messages=ASK)
    assert ok.headers["anthropic-ratelimit-requests-limit"] == "2"
    assert ok.headers["anthropic-ratelimit-requests-remaining"] == "1"
    assert "x-ratelimit-limit-requests" not in ok.headers
    sdk.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    with pytest.raises(anthropic.RateLimitError) as err:
        sdk.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    r = err.value.response
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.headers["anthropic-ratelimit-requests-remaining"] == "0"
    assert r.headers["anthropic-ratelimit-requests-reset"].endswith("Z")
    assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["type"] == "error"


def test_priority_reaches_the_engine_within_the_keys_cap(
    gw: tuple[FakeEngine, TestClient],
) -> None:
    engine, http = gw
    body = {"model": MODEL, "messages": ASK, "max_tokens": 1}

    def sent(key: str, priority: str | None) -> int:
        headers = {"authorization": f"Bearer {key}"}
        if priority is not None:
            headers["x-vcache-priority"] = priority
        r = http.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text
        return engine.received[-1].priority

    assert sent("sk-free", None) == 0
    assert sent("sk-free", "interactive") == -1
    assert sent("sk-free", "batch") == 1
    assert sent("sk-bulk", None) == 1  # the key's default
    assert sent("sk-bulk", "interactive") == 0  # capped at the key's max: default
    bad = http.post(
        "/v1/chat/completions",
        json=body,
        headers={"authorization": "Bearer sk-free", "x-vcache-priority": "urgent"},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-vcache-priority"


def test_a_full_queue_refuses_batch_before_interactive(
    gw: tuple[FakeEngine, TestClient],
) -> None:
    """max_queued_requests 4, batch's share 0.5: two answers in flight fill batch's room;
    default (4) and interactive (1.1 of 4: 5) still get in."""
    _, http = gw
    body = {"model": MODEL, "messages": ASK, "max_tokens": 50, "stream": True}
    auth = {"authorization": "Bearer sk-free"}
    with (
        http.stream("POST", "/v1/chat/completions", json=body, headers=auth) as a,
        http.stream("POST", "/v1/chat/completions", json=body, headers=auth) as b,
    ):
        assert a.status_code == b.status_code == 200
        one = {**body, "stream": False, "max_tokens": 1}
        batch = http.post(
            "/v1/chat/completions", json=one, headers={**auth, "x-vcache-priority": "batch"}
        )
        assert batch.status_code == 503 and batch.json()["error"]["code"] == "queue_full"
        assert int(batch.headers["retry-after"]) >= 1
        urgent = http.post(
            "/v1/chat/completions", json=one, headers={**auth, "x-vcache-priority": "interactive"}
        )
        assert urgent.status_code == 200
    assert 'vcache_requests_shed_total{priority="batch"} 1.0' in http.get("/metrics").text


def test_a_tenant_waits_its_turn_for_a_slot_in_the_engine(tokenizer: ChatTokenizer) -> None:
    """engine.max_num_seqs 1: while one tenant's answer holds the replica's slot, the other
    tenant's request waits in the gateway (counted) and is served when the slot frees."""
    hold = Hold(at=1)  # every answer stays under way until the test lets them go
    engine = FakeEngine(tokenizer, block_size=16, max_model_len=1024, hold=hold)
    cfg = gateway_settings(grpc_port=None, api_keys=_keys(), engine={"max_num_seqs": 1})
    body = {"model": MODEL, "messages": ASK, "max_tokens": 30, "stream": True}
    with TestClient(create_app(cfg, [engine])) as http:
        auth = {"authorization": "Bearer sk-free"}
        with http.stream("POST", "/v1/chat/completions", json=body, headers=auth) as held:
            assert held.status_code == 200
            with ThreadPoolExecutor(1) as pool:
                other = pool.submit(
                    http.post,
                    "/v1/chat/completions",
                    json={**body, "stream": False, "max_tokens": 2},
                    headers={"authorization": "Bearer sk-two"},
                )
                waits = 'vcache_fair_queue_waits_total{replica="replica-0"} 1.0'
                deadline = time.monotonic() + 10
                try:
                    while waits not in http.get("/metrics").text:  # queued, not served
                        assert time.monotonic() < deadline and not other.done()
                        time.sleep(0.01)
                finally:
                    hold.release()
                    for _ in held.iter_lines():  # the held answer ends: its slot frees
                        pass
                assert other.result(timeout=10).status_code == 200
