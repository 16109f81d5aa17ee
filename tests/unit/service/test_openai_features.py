"""The local model's OpenAI features through the official SDK: n, logprobs,
structured outputs, one model by id (an in-memory engine; the real one is in
tests/integration/test_local_features.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from engines.base import Structured
from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from tests.settings import gateway_settings

MODEL = "vcache-demo"
HELLO: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(demo_model: Path) -> FakeEngine:
    tok = ChatTokenizer.from_pretrained(str(demo_model))
    return FakeEngine(tok, block_size=16, max_model_len=512, max_queued_requests=None)


@pytest.fixture(scope="module")
def http(engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(create_app(gateway_settings(grpc_port=None), [engine])) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)


def test_n_choices_whole_and_streamed(sdk: openai.OpenAI) -> None:
    c = sdk.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, n=3)
    assert [ch.index for ch in c.choices] == [0, 1, 2]
    assert all(ch.message.content and ch.finish_reason == "length" for ch in c.choices)
    assert c.usage is not None and c.usage.completion_tokens == 3 * 4
    text: dict[int, str] = {}
    finish: dict[int, str] = {}
    stream = sdk.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=4, n=2, stream=True
    )
    for chunk in stream:
        for ch in chunk.choices:
            text[ch.index] = text.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    assert set(text) == {0, 1} and text[0] == text[1] == c.choices[0].message.content
    assert finish == {0: "length", 1: "length"}


def test_chat_logprobs_with_alternatives(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    c = sdk.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=5, logprobs=True, top_logprobs=3
    )
    lp = c.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 5
    assert "".join(t.token for t in lp.content) == c.choices[0].message.content
    first = lp.content[0]
    assert len(first.top_logprobs) == 3 and first.top_logprobs[0].token == first.token
    assert first.bytes == list(first.token.encode())
    assert engine.received[-1].sampling.logprobs == 3
    plain = sdk.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert plain.choices[0].logprobs is None and engine.received[-1].sampling.logprobs is None


def test_streamed_logprobs_arrive_with_their_text(sdk: openai.OpenAI) -> None:
    stream = sdk.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=4, logprobs=True, stream=True
    )
    tokens = []
    for chunk in stream:
        for ch in chunk.choices:
            if ch.delta.content:
                assert ch.logprobs is not None and ch.logprobs.content is not None
                tokens += [t.token for t in ch.logprobs.content]
                assert "".join(t.token for t in ch.logprobs.content) == ch.delta.content
    assert len(tokens) == 4


def test_completion_logprobs_in_the_legacy_shape(sdk: openai.OpenAI) -> None:
    c = sdk.completions.create(model=MODEL, prompt="hello there", max_tokens=4, logprobs=2)
    lp = c.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs or []) == len(lp.top_logprobs or []) == 4
    assert "".join(lp.tokens) == c.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    assert all(len(t) == 2 for t in lp.top_logprobs or [])


def test_structured_outputs_reach_the_engine(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    c = sdk.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=20, response_format={"type": "json_object"}
    )
    assert engine.received[-1].sampling.structured == Structured(json_object=True)
    assert json.loads(c.choices[0].message.content or "") == {"answer": "fake"}
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    spec = {"name": "a", "schema": schema}
    sdk.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        max_tokens=20,
        extra_body={"response_format": {"type": "json_schema", "json_schema": spec}},
    )
    sent = engine.received[-1].sampling.structured
    assert sent is not None and sent.json_schema is not None
    assert json.loads(sent.json_schema) == schema and not sent.json_object


def test_one_model_by_id(sdk: openai.OpenAI, http: TestClient) -> None:
    m = sdk.models.retrieve(MODEL)
    assert m.id == MODEL
    r = http.get("/v1/models/no-such-model")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
