"""Anthropic's Messages API over an in-memory engine, driven by the official ``anthropic``
SDK: whole and streamed answers, tool round trips, usage in Anthropic's terms, token
counts, session naming and errors as the SDK's typed exceptions.  The real engine's
side (exact prediction, leases under KV pressure) is in
tests/integration/test_messages_local.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.core.config import ApiKeyConfig, hash_api_key
from tests.settings import gateway_settings

MODEL = "vcache-demo"
KEY = "sk-messages"
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER: Any = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
SYSTEM: Any = [
    {"type": "text", "text": "You are a coding agent. " * 30},
    {"type": "text", "text": "Be brief. " * 20, "cache_control": {"type": "ephemeral"}},
]


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(str(demo_model))


def _app(engine: FakeEngine, tmp_path: Path, **settings: Any) -> TestClient:
    log = {"path": str(tmp_path / "s.db"), "verify_reconstruction": True}
    keys = [ApiKeyConfig(sha256=hash_api_key(KEY), tenant="t", name="agent")]
    cfg = gateway_settings(grpc_port=None, session_log=log, api_keys=keys, **settings)
    return TestClient(create_app(cfg, [engine]))


def _sdk(http: TestClient, key: str = KEY, **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url="http://testserver", api_key=key, http_client=http, max_retries=0, **kw
    )


@pytest.fixture
def gw(tokenizer: ChatTokenizer, tmp_path: Path) -> Iterator[tuple[FakeEngine, TestClient]]:
    engine = FakeEngine(tokenizer, block_size=16, max_model_len=2048)
    with _app(engine, tmp_path) as http:
        yield engine, http


@pytest.fixture
def tools_gw(tokenizer: ChatTokenizer, tmp_path: Path) -> Iterator[tuple[FakeEngine, TestClient]]:
    """An engine whose model answers with a Hermes tool call."""
    engine = FakeEngine(tokenizer, block_size=16, max_model_len=2048, reply=CALL_TEXT)
    with _app(engine, tmp_path) as http:
        yield engine, http


def test_whole_message_in_anthropic_shape(gw: tuple[FakeEngine, TestClient]) -> None:
    engine, http = gw
    m = _sdk(http).messages.create(
        model=MODEL, max_tokens=5, system=SYSTEM, messages=[{"role": "user", "content": "hi"}]
    )
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"]
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 5
    prompt = engine.received[0].prompt_token_ids
    u = m.usage
    assert u.input_tokens + (u.cache_read_input_tokens or 0) + (
        u.cache_creation_input_tokens or 0
    ) == len(prompt)
    # the same conversation through /v1/chat/completions is the same prompt, token for token
    chat = {
        "model": MODEL,
        "max_tokens": 5,
        "messages": [
            {"role": "system", "content": "\n\n".join(b["text"] for b in SYSTEM)},
            {"role": "user", "content": "hi"},
        ],
    }
    r = http.post("/v1/chat/completions", json=chat, headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    assert engine.received[1].prompt_token_ids == prompt


def test_breakpoint_usage_creation_then_read(gw: tuple[FakeEngine, TestClient]) -> None:
    engine, http = gw
    sdk = _sdk(http)
    first = sdk.messages.create(
        model=MODEL, max_tokens=3, system=SYSTEM, messages=[{"role": "user", "content": "one"}]
    )
    n = len(engine.received[0].prompt_token_ids)
    u1 = first.usage
    assert u1.cache_read_input_tokens == 0
    assert u1.cache_creation_input_tokens is not None and u1.cache_creation_input_tokens > 0
    assert u1.cache_creation_input_tokens % 16 == 0  # whole KV blocks through the breakpoint
    assert u1.input_tokens + u1.cache_creation_input_tokens == n
    second = sdk.messages.create(
        model=MODEL, max_tokens=3, system=SYSTEM, messages=[{"role": "user", "content": "two"}]
    )
    u2 = second.usage
    # the system prompt through the breakpoint is read back (with any further full block
    # the engine kept: it caches every full block), nothing new is written through it
    assert u1.cache_creation_input_tokens <= (u2.cache_read_input_tokens or 0) < n
    assert u2.cache_creation_input_tokens == 0
    read = u2.cache_read_input_tokens or 0
    assert u2.input_tokens + read == len(engine.received[1].prompt_token_ids)


def test_count_tokens_equals_the_next_requests_prompt(gw: tuple[FakeEngine, TestClient]) -> None:
    _, http = gw
    sdk = _sdk(http)
    messages: Any = [{"role": "user", "content": [{"type": "text", "text": "count me " * 40}]}]
    counted = sdk.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages)
    for _ in range(2):  # cold, then warm: the three parts always add up to the count
        u = sdk.messages.create(model=MODEL, max_tokens=2, system=SYSTEM, messages=messages).usage
        total = u.input_tokens + (u.cache_read_input_tokens or 0)
        assert total + (u.cache_creation_input_tokens or 0) == counted.input_tokens


def test_stream_events_parse_with_the_sdk(gw: tuple[FakeEngine, TestClient]) -> None:
    _, http = gw
    kinds, started = [], None
    with _sdk(http).messages.stream(
        model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "stream"}]
    ) as s:
        for ev in s:
            kinds.append(ev.type)
            if ev.type == "message_start":
                started = ev.message.usage
        final = s.get_final_message()
    # the prompt's tokens are known at the first token: message_start says them already
    assert started is not None and started.output_tokens == 0
    assert started.input_tokens == final.usage.input_tokens > 0
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert kinds[-2] == "message_delta"
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    assert final.usage.input_tokens > 0  # the totals arrive with message_delta
    text = final.content[0]
    assert text.type == "text" and text.text.startswith("hello from the fake")


def test_raw_stream_has_ping_and_no_done_marker(gw: tuple[FakeEngine, TestClient]) -> None:
    _, http = gw
    body = {
        "model": MODEL,
        "max_tokens": 2,
        "stream": True,
        "messages": [{"role": "user", "content": "raw"}],
    }
    with http.stream("POST", "/v1/messages", json=body, headers={"x-api-key": KEY}) as r:
        assert r.status_code == 200
        assert r.headers["request-id"].startswith("req_")
        text = "".join(r.iter_text())
    events = [
        line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event:")
    ]
    assert events[:2] == ["message_start", "ping"]
    assert "[DONE]" not in text


def test_tool_round_trip(tools_gw: tuple[FakeEngine, TestClient]) -> None:
    engine, http = tools_gw
    sdk = _sdk(http)
    ask: Any = [{"role": "user", "content": "weather in Paris?"}]
    forced = sdk.messages.create(
        model=MODEL,
        max_tokens=64,
        tools=[WEATHER],
        messages=ask,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert [(b.type, getattr(b, "name", None)) for b in forced.content] == [
        ("tool_use", "get_weather")
    ]  # the arguments are the engine's constrained JSON (the fake's own object)
    m = sdk.messages.create(model=MODEL, max_tokens=64, tools=[WEATHER], messages=ask)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    follow: Any = [
        *ask,
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": "sunny, 21 C",
                    "cache_control": {"type": "ephemeral"},
                },
            ],
        },
    ]
    again = sdk.messages.create(model=MODEL, max_tokens=8, tools=[WEATHER], messages=follow)
    assert again.usage.output_tokens > 0
    shown = http.app.state.service.local.engine.tokenizer.decode(  # type: ignore[attr-defined]
        list(engine.received[-1].prompt_token_ids)
    )
    assert "sunny, 21 C" in shown and '"city": "Paris"' in shown


def test_streamed_tool_use_has_input_json_deltas(tools_gw: tuple[FakeEngine, TestClient]) -> None:
    _, http = tools_gw
    with _sdk(http).messages.stream(
        model=MODEL,
        max_tokens=64,
        tools=[WEATHER],
        messages=[{"role": "user", "content": "weather?"}],
    ) as s:
        events = list(s)
        final = s.get_final_message()
    deltas = [ev.delta.type for ev in events if ev.type == "content_block_delta"]
    assert events[0].type == "message_start" and events[0].message.usage.input_tokens > 0
    assert "input_json_delta" in deltas
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.input == {"city": "Paris"} and final.stop_reason == "tool_use"


def test_session_named_by_the_agents_header(gw: tuple[FakeEngine, TestClient]) -> None:
    _, http = gw
    sid = "0f9c1d2e-3b4a-4c5d-8e7f-a1b2c3d4e5f6"
    raw = _sdk(http).messages.with_raw_response.create(
        model=MODEL,
        max_tokens=2,
        messages=[{"role": "user", "content": "agent turn"}],
        extra_headers={"X-Claude-Code-Session-Id": sid, "anthropic-beta": "a,b"},
        extra_query={"beta": "true"},
    )
    assert raw.headers["x-vcache-session"] == sid
    meta = json.dumps({"device_id": "d", "session_id": "sess-from-metadata"})
    raw = _sdk(http).messages.with_raw_response.create(
        model=MODEL,
        max_tokens=2,
        messages=[{"role": "user", "content": "meta turn"}],
        metadata={"user_id": meta},
    )
    assert raw.headers["x-vcache-session"] == "sess-from-metadata"


def test_max_tokens_past_the_context_is_clamped(gw: tuple[FakeEngine, TestClient]) -> None:
    engine, http = gw
    with _sdk(http).messages.with_streaming_response.create(
        model=MODEL,
        max_tokens=32000,
        stream=True,
        messages=[{"role": "user", "content": "long answer"}],
    ) as raw:
        room = 2048 - len(engine.received[-1].prompt_token_ids)
        assert raw.headers["x-vcache-max-tokens-clamped"] == str(room)
        assert engine.received[-1].sampling.max_tokens == room


def _error(http: TestClient, body: Any, headers: dict[str, str] | None = None) -> Any:
    return http.post("/v1/messages", json=body, headers=headers or {"x-api-key": KEY})


def test_errors_in_anthropic_shape(gw: tuple[FakeEngine, TestClient]) -> None:
    _, http = gw
    ok: Any = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]}
    r = _error(http, {**ok, "frequency_penalty": 1})
    assert r.status_code == 400
    assert r.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "Invalid value for 'frequency_penalty': Extra inputs are not permitted",
        },
        "request_id": r.headers["request-id"],
    }
    found = {"type": "search_result", "source": "s", "title": "t", "content": []}
    r = _error(http, {**ok, "messages": [{"role": "user", "content": [found]}]})
    assert (
        r.status_code == 400
        and "'search_result' content is not supported" in r.json()["error"]["message"]
    )
    long = {**ok, "messages": [{"role": "user", "content": "word " * 4000}]}
    r = _error(http, long)
    assert r.status_code == 400
    assert "maximum context length is 2048 tokens" in r.json()["error"]["message"]
    r = _error(http, {**ok, "model": "no-such-model"})
    assert (r.status_code, r.json()["error"]["type"]) == (404, "not_found_error")


def test_errors_raise_the_sdks_typed_exceptions(
    tokenizer: ChatTokenizer, tmp_path: Path, gw: tuple[FakeEngine, TestClient]
) -> None:
    _, http = gw
    ask: Any = [{"role": "user", "content": "x"}]
    with pytest.raises(anthropic.BadRequestError):
        _sdk(http).messages.create(
            model=MODEL, max_tokens=4, messages=ask, extra_body={"top_k": -1}
        )
    with pytest.raises(anthropic.AuthenticationError) as auth:
        _sdk(http, key="sk-wrong").messages.create(model=MODEL, max_tokens=4, messages=ask)
    assert auth.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    busy = FakeEngine(tokenizer, block_size=16, max_model_len=2048, max_queued_requests=0)
    with _app(busy, tmp_path / "busy") as h, pytest.raises(anthropic.OverloadedError) as over:
        _sdk(h).messages.create(model=MODEL, max_tokens=4, messages=ask)
    assert over.value.status_code == 529
    assert over.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    assert over.value.response.headers["retry-after"] == "1"


def test_body_over_the_limit_is_413_in_anthropic_shape(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    engine = FakeEngine(tokenizer, block_size=16, max_model_len=2048)
    with _app(engine, tmp_path, max_request_body_bytes=1024) as http:
        big = {
            "model": MODEL,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "x" * 2000}],
        }
        r = _error(http, big)
        assert r.status_code == 413
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "request_too_large"
        assert r.json()["request_id"] == r.headers["request-id"]
        chat = http.post("/v1/chat/completions", json=big)
        assert chat.status_code == 413 and "error" in chat.json() and "type" not in chat.json()
