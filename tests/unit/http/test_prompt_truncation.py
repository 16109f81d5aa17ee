"""vLLM's prompt options beyond the template's variables: a request's own chat template
(only where the gateway trusts them), ``truncate_prompt_tokens`` / ``truncation_side``
and ``add_special_tokens``.  The engine gets the ids vLLM's server would tokenize, and
the session log rebuilds them byte for byte (verified on every chat here)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from tokenizers.processors import TemplateProcessing

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from tests.settings import gateway_settings

MODEL = "vcache-demo"
ASK: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse and you answer every question briefly."},
    {"role": "user", "content": "what is two and two, and why is it four?"},
]
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
MAX_LEN = 256

Gateway = tuple[FakeEngine, TestClient]


def _gateway(demo_model: Path, tmp_path: Path, trust: bool) -> Iterator[Gateway]:
    engine = FakeEngine(ChatTokenizer.from_pretrained(str(demo_model)), max_model_len=MAX_LEN)
    log = {"path": str(tmp_path / "s.db"), "verify_reconstruction": True}
    settings = gateway_settings(
        grpc_port=None, session_log=log, engine={"trust_request_chat_template": trust}
    )
    with TestClient(create_app(settings, [engine])) as http:
        yield engine, http


@pytest.fixture
def gw(demo_model: Path, tmp_path: Path) -> Iterator[Gateway]:
    yield from _gateway(demo_model, tmp_path, trust=False)


@pytest.fixture
def trusting(demo_model: Path, tmp_path: Path) -> Iterator[Gateway]:
    yield from _gateway(demo_model, tmp_path, trust=True)


def _chat(gw: Gateway, **extra: Any) -> list[int]:
    engine, http = gw
    body = {"model": MODEL, "messages": ASK, "max_tokens": 1, **extra}
    r = http.post("/v1/chat/completions", json=body, headers={"x-vcache-session": "cut"})
    assert r.status_code == 200, r.text  # and the log rebuilt what was sent
    return list(engine.received[-1].prompt_token_ids)


def _text(gw: Gateway, **extra: Any) -> list[int]:
    engine, http = gw
    body = {"model": MODEL, "prompt": ASK[1]["content"], "max_tokens": 1, **extra}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return list(engine.received[-1].prompt_token_ids)


def test_a_request_chat_template_is_refused_unless_trusted(gw: Gateway) -> None:
    _, http = gw
    body = {"model": MODEL, "messages": ASK, "max_tokens": 1, "chat_template": PLAIN}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "chat_template" and "trust" in err["message"]


def test_a_trusted_chat_template_renders_the_prompt(trusting: Gateway) -> None:
    tok = trusting[0].tokenizer
    ids = _chat(trusting, chat_template=PLAIN)
    assert tok.decode(ids) == f"system: {ASK[0]['content']}\nuser: {ASK[1]['content']}\n"
    assert ids != _chat(trusting)  # the model's own template otherwise


def test_chat_prompts_are_truncated_from_the_side_asked(gw: Gateway) -> None:
    whole = _chat(gw)
    assert _chat(gw, truncate_prompt_tokens=5) == whole[-5:]  # the start is cut
    assert _chat(gw, truncate_prompt_tokens=5, truncation_side="right") == whole[:5]
    assert _chat(gw, truncate_prompt_tokens=len(whole) + 10) == whole  # nothing to cut


def test_text_prompts_are_truncated_and_minus_one_keeps_what_fits(gw: Gateway) -> None:
    whole = _text(gw)
    assert _text(gw, truncate_prompt_tokens=3) == whole[-3:]
    long = {"prompt": "two and four " * 200}  # past the context
    cut = _text(gw, truncate_prompt_tokens=-1, **long)
    assert len(cut) == MAX_LEN - 1  # one token left to generate, as vLLM leaves it


@pytest.mark.parametrize(
    ("path", "keep"),
    [
        ("/v1/chat/completions", MAX_LEN + 1),
        ("/v1/completions", MAX_LEN + 1),
        ("/v1/chat/completions", 0),
        ("/v1/completions", -2),
    ],
)
def test_truncation_past_the_context_or_to_nothing_is_a_400(
    gw: Gateway, path: str, keep: int
) -> None:
    engine, http = gw
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 1, "truncate_prompt_tokens": keep}
    body.update({"messages": ASK} if "chat" in path else {"prompt": "two"})
    before = len(engine.received)
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "truncate_prompt_tokens"
    assert len(engine.received) == before


def test_special_tokens_are_added_as_vllm_adds_them(gw: Gateway) -> None:
    """Text completions add the tokenizer's special tokens (a BOS) by default, as vLLM's
    server does; chat does not (the template writes them) unless asked."""
    engine, _ = gw
    hf = engine.tokenizer.hf
    bos = hf.convert_tokens_to_ids("<|im_start|>")
    hf.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)]
    )
    bare = engine.tokenizer.encode(ASK[1]["content"])
    assert _text(gw) == [bos, *bare]
    assert _text(gw, add_special_tokens=False) == bare
    chat = _chat(gw)
    assert _chat(gw, add_special_tokens=True) == [bos, *chat]
