"""vLLM's prompt shaping on chat (chat_template_kwargs, add_generation_prompt,
continue_final_message), rendered by vcache's own template path, so the engine gets
exactly what the session log rebuilds (verified on every request here)."""

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
ASK: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "what is two and two?"},
]
PARTIAL = [*ASK, {"role": "assistant", "content": "The answer is"}]


@pytest.fixture
def gw(demo_model: Path, tmp_path: Path) -> Iterator[tuple[FakeEngine, TestClient]]:
    engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)), max_model_len=1024)
    log = {"path": str(tmp_path / "s.db"), "verify_reconstruction": True}
    with TestClient(
        create_app(gateway_settings(grpc_port=None, session_log=log), [engine])
    ) as http:
        yield engine, http


def _sent(gw: tuple[FakeEngine, TestClient], messages: Any, **extra: Any) -> list[int]:
    engine, http = gw
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, **extra}
    r = http.post("/v1/chat/completions", json=body, headers={"x-vcache-session": "shaped"})
    assert r.status_code == 200, r.text  # and the log rebuilt it byte for byte
    return list(engine.received[-1].prompt_token_ids)


def test_chat_template_kwargs_reach_the_template(gw: tuple[FakeEngine, TestClient]) -> None:
    tok = gw[0].tokenizer
    plain = _sent(gw, ASK)
    shaped = _sent(gw, ASK, chat_template_kwargs={"enable_thinking": False})
    assert shaped == tok.render_chat(ASK, template_kwargs={"enable_thinking": False})
    assert shaped[: len(plain)] == plain  # the same prompt, then the empty think block
    assert tok.decode(shaped[len(plain) :]) == "<think>\n\n</think>\n\n"


def test_no_generation_prompt_and_a_continued_message(gw: tuple[FakeEngine, TestClient]) -> None:
    tok = gw[0].tokenizer
    bare = _sent(gw, ASK, add_generation_prompt=False)
    assert bare == tok.render_chat(ASK, generation_prompt=False)
    ready = _sent(gw, ASK)
    assert ready[: len(bare)] == bare and tok.decode(ready[len(bare) :]) == "assistant\n"
    going_on = _sent(gw, PARTIAL, add_generation_prompt=False, continue_final_message=True)
    assert going_on == tok.render_chat(PARTIAL, generation_prompt=False, continue_final=True)
    assert going_on[: len(bare)] == bare  # then the assistant's message, left open
    assert tok.decode(going_on[len(bare) :]) == "assistant\nThe answer is"


@pytest.mark.parametrize(
    ("messages", "extra", "param"),
    [
        (PARTIAL, {"continue_final_message": True}, "continue_final_message"),
        (
            ASK,
            {"continue_final_message": True, "add_generation_prompt": False},
            "continue_final_message",
        ),
        (ASK, {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        (ASK, {"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
    ],
)
def test_what_cannot_be_rendered_is_a_400(
    gw: tuple[FakeEngine, TestClient], messages: Any, extra: dict[str, Any], param: str
) -> None:
    _, http = gw
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, **extra}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_text_completions_have_no_template_to_shape(gw: tuple[FakeEngine, TestClient]) -> None:
    _, http = gw
    body = {"model": MODEL, "prompt": "x", "chat_template_kwargs": {"enable_thinking": False}}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "unsupported_parameter"


def test_vllms_session_id_names_the_session_where_no_header_does(
    gw: tuple[FakeEngine, TestClient],
) -> None:
    _, http = gw
    body = {"model": MODEL, "messages": ASK, "max_tokens": 2, "session_id": "agent-run-7"}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.headers["x-vcache-session"] == "agent-run-7"
    r = http.post("/v1/chat/completions", json=body, headers={"x-vcache-session": "mine"})
    assert r.headers["x-vcache-session"] == "mine"  # the header wins
    r = http.post("/v1/chat/completions", json={**body, "session_id": "no spaces"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id"
