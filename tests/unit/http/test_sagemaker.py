"""The routes vLLM's server offers beside the OpenAI API: ``/invocations`` (SageMaker:
chat or text by the body's shape, through the same handlers and errors), ``/ping`` and
``/load`` (the requests being served now, as load-aware routers read it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine, Hold
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from tests.settings import gateway_settings

MODEL = "vcache-demo"
ASK = [{"role": "user", "content": "say hello"}]

Gateway = tuple[FakeEngine, TestClient]


@pytest.fixture
def gw(demo_model: Path) -> Iterator[Gateway]:
    tok = ChatTokenizer.from_pretrained(str(demo_model))
    engine = FakeEngine(tok, max_model_len=512)
    with TestClient(create_app(gateway_settings(grpc_port=None), [engine])) as http:
        yield engine, http


def test_invocations_answer_chat_and_text_by_the_bodys_shape(gw: Gateway) -> None:
    engine, http = gw
    chat = http.post("/invocations", json={"model": MODEL, "messages": ASK, "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    assert chat.headers["x-vcache-replica"]  # the same handler, its headers too
    text = http.post("/invocations", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert text.status_code == 200 and text.json()["object"] == "text_completion"
    assert engine.received[-1].prompt_token_ids == tuple(engine.tokenizer.encode("hi"))
    streamed = {"model": MODEL, "messages": ASK, "max_tokens": 2, "stream": True}
    with http.stream("POST", "/invocations", json=streamed) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert any(line == "data: [DONE]" for line in r.iter_lines())


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": ASK, "temperature": 9}, "temperature"),
        ({"model": MODEL, "prompt": "hi", "best_of": 3}, "best_of"),
        ([1, 2], None),
    ],
)
def test_invocations_refuse_what_neither_api_takes(gw: Gateway, body: Any, param: str) -> None:
    _, http = gw
    r = http.post("/invocations", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    bad = http.post("/invocations", content=b"{not json", headers={"content-type": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"


def test_load_counts_the_requests_being_served(demo_model: Path) -> None:
    hold = Hold(at=1)  # the answer stays under way until the test lets it end
    engine = FakeEngine(
        ChatTokenizer.from_pretrained(str(demo_model)), max_model_len=512, hold=hold
    )
    with TestClient(create_app(gateway_settings(grpc_port=None), [engine])) as http:
        assert http.get("/load").json() == {"server_load": 0}
        body = {"model": MODEL, "messages": ASK, "max_tokens": 20, "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # under way
            assert http.get("/load").json() == {"server_load": 1}
            hold.release()
            assert any(line == "data: [DONE]" for line in lines)
        assert http.get("/load").json() == {"server_load": 0}
        assert http.get("/ping").json() == {"status": "ok"}


def test_a_request_without_model_is_the_local_models(gw: Gateway) -> None:
    """vLLM's server takes a request that names no model as its own model's."""
    _, http = gw
    chat = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2})
    assert chat.status_code == 200, chat.text
    assert chat.json()["model"] == MODEL
    text = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert text.status_code == 200 and text.json()["model"] == MODEL


def test_without_a_local_model_the_model_must_be_named(demo_model: Path) -> None:
    with TestClient(create_app(gateway_settings(grpc_port=None), [])) as http:
        r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "missing_required_parameter"
    assert r.json()["error"]["param"] == "model"
