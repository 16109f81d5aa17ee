"""vLLM's /tokenize and /detokenize, and /ping: the ids are exactly what the request path
sends the engine (chat through its template with tools, prompts as completions send
them); what would make them differ is refused by name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from tests.settings import gateway_settings

MODEL = "vcache-demo"
TOOLS: Any = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
MESSAGES: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]


@pytest.fixture
def gw(demo_model: Path) -> Iterator[tuple[FakeEngine, TestClient]]:
    engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)), block_size=16)
    with TestClient(create_app(gateway_settings(grpc_port=None), [engine])) as http:
        yield engine, http


def test_chat_ids_are_what_chat_completions_sends(gw: tuple[FakeEngine, TestClient]) -> None:
    engine, http = gw
    got = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES, "tools": TOOLS})
    assert got.status_code == 200, got.text
    chat = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 1}
    http.post("/v1/chat/completions", json=chat)
    body = got.json()
    assert body["tokens"] == list(engine.received[-1].prompt_token_ids)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    assert body["block_hashes"] is None  # no KV events from the in-memory engine


def test_prompt_ids_are_what_completions_sends(gw: tuple[FakeEngine, TestClient]) -> None:
    engine, http = gw
    got = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})
    http.post("/v1/completions", json={"model": MODEL, "prompt": "hello world", "max_tokens": 1})
    body = got.json()
    assert body["tokens"] == list(engine.received[-1].prompt_token_ids)
    assert "".join(body["token_strs"]).replace(" ", "") == "helloworld"
    back = http.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "hello world"}


def test_shaped_ids_are_what_the_shaped_request_sends(gw: tuple[FakeEngine, TestClient]) -> None:
    """add_generation_prompt and add_special_tokens shape /tokenize as they shape chat
    and completions (vLLM's defaults: special tokens for a prompt, none for messages)."""
    engine, http = gw
    shaped = {"add_generation_prompt": False, "add_special_tokens": True}
    got = http.post("/tokenize", json={"messages": MESSAGES, **shaped})
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 1, **shaped}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    assert got.json()["tokens"] == list(engine.received[-1].prompt_token_ids)
    bare = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert got.json()["tokens"] != bare  # no generation prompt
    for special in (True, False):
        got = http.post("/tokenize", json={"prompt": "hi there", "add_special_tokens": special})
        text = {"model": MODEL, "prompt": "hi there", "max_tokens": 1}
        http.post("/v1/completions", json={**text, "add_special_tokens": special})
        assert got.json()["tokens"] == list(engine.received[-1].prompt_token_ids)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, None),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [10**9]}, "tokens[0]"),
    ],
)
def test_what_would_differ_is_refused(
    gw: tuple[FakeEngine, TestClient], path: str, body: dict[str, Any], param: str | None
) -> None:
    _, http = gw
    r = http.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    if param is not None:
        assert r.json()["error"]["param"] == param


def test_ping(gw: tuple[FakeEngine, TestClient]) -> None:
    _, http = gw
    for r in (http.get("/ping"), http.post("/ping")):
        assert r.status_code == 200 and r.json() == {"status": "ok"}


PNG = (  # a 1x1 PNG
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGP4z8DwHwAFAAH/"
    "iZk9HQAAAABJRU5ErkJggg=="
)
IMAGE_TURN: Any = {
    "role": "user",
    "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": PNG}},
    ],
}


def test_an_image_for_the_local_model_is_refused_by_name(
    gw: tuple[FakeEngine, TestClient],
) -> None:
    """The local model reads text only: counting a prompt with an image is a 400 naming
    the part, never a 500 from the renderer (the cache API's lookup and warm render
    through the same LocalChat.chat_tokens)."""
    engine, http = gw
    got = http.post("/tokenize", json={"model": MODEL, "messages": [MESSAGES[0], IMAGE_TURN]})
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["param"] == "messages[1].content[1]" and "text only" in error["message"]
    assert engine.received == []  # nothing reached the engine
