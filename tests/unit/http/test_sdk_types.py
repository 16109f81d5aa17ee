"""Every answer the gateway gives, validated strictly by the official SDKs' own types
(``model_validate``, not the lenient construct their ``create`` calls do): chat
completions and their chunks, text completions, Responses and each of their stream
events, Messages and each of theirs.  A field today's SDK requires and the gateway
leaves out fails here first (``input_tokens_details.cache_write_tokens`` did)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from fastapi.testclient import TestClient
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from tests.settings import gateway_settings

MODEL = "vcache-demo"
SYSTEM = "You are terse. " * 30
TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def http(demo_model: Path) -> Iterator[TestClient]:
    engine = FakeEngine(
        ChatTokenizer.from_pretrained(str(demo_model)), block_size=16, max_model_len=2048
    )
    with TestClient(create_app(gateway_settings(), [engine])) as client:
        yield client


def _events(http: TestClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON of each SSE event of a streamed answer (``[DONE]`` left out)."""
    out = []
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def test_chat_completions_whole_and_streamed(http: TestClient) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "logprobs": True,
        "top_logprobs": 2,
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    whole = ChatCompletion.model_validate(r.json())
    assert whole.usage is not None and whole.choices[0].logprobs is not None
    usage = {"stream_options": {"include_usage": True}}
    events = _events(http, "/v1/chat/completions", body | usage)
    chunks = [ChatCompletionChunk.model_validate(e) for e in events]
    assert chunks[-1].usage is not None


def test_text_completions_whole_and_streamed(http: TestClient) -> None:
    body = {"model": MODEL, "prompt": SYSTEM, "max_tokens": 4, "logprobs": 2}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert Completion.model_validate(r.json()).usage is not None
    events = _events(http, "/v1/completions", body | {"stream_options": {"include_usage": True}})
    # a chunk before the last has finish_reason null, as OpenAI's own stream does (the
    # SDK reads chunks leniently: its type admits only a finished choice)
    ended = [e for e in events if all(c["finish_reason"] for c in e["choices"])]
    assert [Completion.model_validate(e) for e in ended][-1].usage is not None


def test_responses_whole_and_each_stream_event(http: TestClient) -> None:
    body = {"model": MODEL, "instructions": SYSTEM, "input": "hi", "tools": [TOOL]}
    r = http.post("/v1/responses", json=body | {"max_output_tokens": 4})
    assert r.status_code == 200, r.text
    assert Response.model_validate(r.json()).usage is not None
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(e) for e in _events(http, "/v1/responses", body)]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage is not None


def test_a_response_echoes_its_json_schema_format_as_openai_names_it(http: TestClient) -> None:
    """``text.format.schema`` (the wire's name), not the model's ``schema_``: the SDK's
    type requires it, in the answer and in each stream event that carries the response."""
    schema = {"type": "object", "properties": {"label": {"type": "string"}}}
    fmt = {"type": "json_schema", "name": "label", "schema": schema, "strict": True}
    body = {"model": MODEL, "input": "label it", "text": {"format": fmt}}
    r = http.post("/v1/responses", json=body | {"max_output_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["text"]["format"]["schema"] == schema
    assert "schema_" not in r.json()["text"]["format"]
    echoed = Response.model_validate(r.json()).text
    assert echoed is not None and echoed.format is not None
    assert echoed.format.type == "json_schema" and echoed.format.schema_ == schema
    adapter: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(e) for e in _events(http, "/v1/responses", body)]
    assert events[-1].response.text.format.schema_ == schema


def test_messages_whole_and_each_stream_event(http: TestClient) -> None:
    body = {
        "model": MODEL,
        "system": SYSTEM,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [
            {
                "name": "get_weather",
                "description": "The weather in a city",
                "input_schema": TOOL["parameters"],
            }
        ],
    }
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    assert Message.model_validate(r.json()).usage is not None
    adapter: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
    # ping is Anthropic's keep-alive, which the SDK skips before typing the events
    sent = [e for e in _events(http, "/v1/messages", body) if e["type"] != "ping"]
    events = [adapter.validate_python(e) for e in sent]
    assert events[0].type == "message_start"
    assert events[-1].type == "message_stop"
