"""Tool calls on the local model (an in-memory engine; the real one is exercised in
tests/integration/test_local_tools.py): forced, required and auto tool choices,
whole and streamed, and the conversation that goes on in the session log."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from tests.settings import gateway_settings

MODEL = "vcache-demo"
WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK: list[Any] = [{"role": "user", "content": "weather in Paris?"}]


def _gateway(engine: FakeEngine, tmp_path: Path) -> TestClient:
    log = {"path": str(tmp_path / "s.db"), "verify_reconstruction": True}
    return TestClient(create_app(gateway_settings(grpc_port=None, session_log=log), [engine]))


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(str(demo_model))


@pytest.fixture
def forced(tokenizer: ChatTokenizer, tmp_path: Path) -> Iterator[tuple[FakeEngine, openai.OpenAI]]:
    engine = FakeEngine(tokenizer, block_size=16, max_model_len=2048)
    with _gateway(engine, tmp_path) as http:
        yield engine, openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)


@pytest.fixture
def caller(tokenizer: ChatTokenizer, tmp_path: Path) -> Iterator[tuple[FakeEngine, openai.OpenAI]]:
    """An engine whose model answers with a Hermes tool call (then a word of text)."""
    engine = FakeEngine(
        tokenizer, block_size=16, max_model_len=2048, reply="Let me check. " + CALL_TEXT
    )
    with _gateway(engine, tmp_path) as http:
        yield engine, openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)


def _reply_len(tokenizer: ChatTokenizer) -> int:
    return len(tokenizer.encode("Let me check. " + CALL_TEXT))


def test_a_named_tool_choice_constrains_the_answer_to_its_parameters(
    forced: tuple[FakeEngine, openai.OpenAI],
) -> None:
    engine, sdk = forced
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    c = sdk.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=30, tools=[WEATHER], tool_choice=choice
    )
    sent = engine.received[-1].sampling.structured
    assert (
        sent is not None and json.loads(sent.json_schema or "") == WEATHER["function"]["parameters"]
    )
    msg: Any = c.choices[0].message
    assert c.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert msg.tool_calls is not None and len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"answer": "fake"}  # what the fake model wrote


def test_a_named_tool_choice_streams_argument_deltas(
    forced: tuple[FakeEngine, openai.OpenAI],
) -> None:
    _, sdk = forced
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    stream: Any = sdk.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=30, tools=[WEATHER], tool_choice=choice, stream=True
    )
    deltas = [d for chunk in stream for ch in chunk.choices for d in ch.delta.tool_calls or []]
    assert len(deltas) > 1  # streamed in parts, not at the end
    assert deltas[0].id and deltas[0].function and deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function and d.function.name is None for d in deltas[1:])
    args = "".join((d.function.arguments or "") for d in deltas if d.function)
    assert json.loads(args) == {"answer": "fake"}


def test_auto_reads_the_calls_with_vllms_parser(
    caller: tuple[FakeEngine, openai.OpenAI], tokenizer: ChatTokenizer
) -> None:
    engine, sdk = caller
    n = _reply_len(tokenizer)
    c = sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=n, tools=[WEATHER])
    assert engine.received[-1].sampling.structured is None  # the model writes freely
    msg: Any = c.choices[0].message
    assert c.choices[0].finish_reason == "tool_calls"
    assert msg.content is not None and msg.content.strip() == "Let me check."
    assert msg.tool_calls is not None and msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris"}
    # streamed: the text before the call streams as content, the call comes whole
    stream: Any = sdk.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=n, tools=[WEATHER], stream=True
    )
    content, finish = "", None
    calls: list[Any] = []
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            calls += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert content.strip() == "Let me check." and "<tool_call>" not in content
    assert [d.function.name for d in calls if d.function] == ["get_weather"]
    assert finish == "tool_calls"


def test_the_tools_are_rendered_into_the_prompt(
    caller: tuple[FakeEngine, openai.OpenAI], tokenizer: ChatTokenizer
) -> None:
    engine, sdk = caller
    sdk.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, tools=[WEATHER])
    prompt = tokenizer.decode(list(engine.received[-1].prompt_token_ids))
    assert "get_weather" in prompt and "<tools>" in prompt


def test_a_tool_round_trip_continues_the_session_and_rebuilds(
    caller: tuple[FakeEngine, openai.OpenAI], tokenizer: ChatTokenizer
) -> None:
    engine, sdk = caller
    n = _reply_len(tokenizer)
    first = sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=ASK, max_tokens=n, tools=[WEATHER]
    )
    msg: Any = first.parse().choices[0].message
    assert msg.tool_calls
    call = msg.tool_calls[0]
    follow: list[Any] = [
        *ASK,
        {
            "role": "assistant",
            "content": msg.content,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny"}'},
    ]
    second = sdk.chat.completions.with_raw_response.create(
        model=MODEL, messages=follow, max_tokens=3, tools=[WEATHER]
    )
    assert second.http_response.status_code == 200  # verified against the log before sending
    assert second.headers["x-vcache-session"] == first.headers["x-vcache-session"]
    prompt = tokenizer.decode(list(engine.received[-1].prompt_token_ids))
    assert "<tool_response>" in prompt and "sunny" in prompt
