"""Requests vLLM's server and OpenAI's API answer in a particular way, answered the same
way here (issue 22's bugs): stream_options without stream, a tool_choice without tools,
text completions' default max_tokens and their top_logprobs."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine

MODEL = "vcache-demo"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_options_need_stream(gw: tuple[FakeEngine, TestClient], path: str) -> None:
    _, http = gw
    body = {**CHAT, "prompt": "hi", "stream_options": {"include_usage": True}}
    if path == "/v1/completions":
        body.pop("messages")
    r = http.post(path, json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stream_options"
    assert "only allowed when 'stream' is enabled" in r.json()["error"]["message"]


def test_a_tool_choice_needs_tools_except_none(gw: tuple[FakeEngine, TestClient]) -> None:
    _, http = gw
    for choice in ("auto", "required"):
        r = http.post("/v1/chat/completions", json={**CHAT, "tool_choice": choice})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", choice
    assert http.post("/v1/chat/completions", json={**CHAT, "tool_choice": "none"}).is_success


def test_text_completions_default_to_16_tokens(gw: tuple[FakeEngine, TestClient]) -> None:
    engine, http = gw
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "probe 5"})
    assert r.status_code == 200
    assert engine.received[-1].sampling.max_tokens == 16
    assert r.json()["usage"]["completion_tokens"] == 16
    near = {"model": MODEL, "prompt": [1] * 505}  # the default fits what the context leaves
    assert http.post("/v1/completions", json=near).status_code == 200
    assert engine.received[-1].sampling.max_tokens == 512 - 505


def test_completion_top_logprobs_include_the_sampled_token(
    gw: tuple[FakeEngine, TestClient],
) -> None:
    _, http = gw
    body = {"model": MODEL, "prompt": "probe 5", "max_tokens": 3, "temperature": 0}
    for n in (0, 2):
        lp = http.post("/v1/completions", json={**body, "logprobs": n}).json()
        lp = lp["choices"][0]["logprobs"]
        for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=True):
            assert token in top and 1 <= len(top) <= n + 1


def test_models_name_their_root(gw: tuple[FakeEngine, TestClient]) -> None:
    _, http = gw
    (card,) = http.get("/v1/models").json()["data"]
    assert card["root"] == MODEL and card["parent"] is None  # the fake loads no path


def test_logit_bias_is_validated_and_reaches_the_engine(
    gw: tuple[FakeEngine, TestClient],
) -> None:
    engine, http = gw
    ok = http.post("/v1/chat/completions", json={**CHAT, "logit_bias": {"1500": 100, "7": -5}})
    assert ok.status_code == 200
    assert engine.received[-1].sampling.logit_bias == ((7, -5.0), (1500, 100.0))
    for bias, says in (
        ({"bad1": 50}, "'bad1' is not a token id"),
        ({"5": 101}, "less than or equal to 100"),
        ({"999999": 1}, "out of vocabulary"),
    ):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logit_bias": bias})
        assert r.status_code == 400, bias
        assert r.json()["error"]["param"].startswith("logit_bias") and says in r.text, r.text
