"""vLLM's ``/v1/chat/completions/batch``: one choice per conversation, in order, each its
own engine request (its own prompt and prediction), the usage summed; what the endpoint
does not take (a stream, tools, several samples) is a 400 naming it."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine

MODEL = "vcache-demo"
CONVS = [
    [{"role": "user", "content": "first conversation"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "second one"}],
    [{"role": "user", "content": "the third"}],
]

Gateway = tuple[FakeEngine, TestClient]


def test_one_choice_per_conversation_in_order(gw: Gateway) -> None:
    engine, http = gw
    before = len(engine.received)
    r = http.post(
        "/v1/chat/completions/batch", json={"model": MODEL, "messages": CONVS, "max_tokens": 3}
    )
    assert r.status_code == 200, r.text
    out = r.json()
    sent = engine.received[before:]
    tok = engine.tokenizer
    assert sorted(g.prompt_token_ids for g in sent) == sorted(
        tuple(tok.render_chat(c)) for c in CONVS
    )  # each conversation through the template, as a chat of its own
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert all(c["message"]["role"] == "assistant" for c in out["choices"])
    assert out["usage"]["prompt_tokens"] == sum(g.num_prompt_tokens for g in sent)
    assert out["usage"]["completion_tokens"] == 9
    assert r.headers["x-vcache-replica"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream": True}, "stream"),
        ({"n": 2}, "n"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "not a list of lists"}]}, "messages"),
        ({"messages": [CONVS[0], [{"role": "bogus", "content": "x"}]]}, "messages[1][0].role"),
        ({"temperature": 7}, "temperature"),
    ],
)
def test_what_a_batch_cannot_be_is_a_400(gw: Gateway, extra: dict[str, Any], param: str) -> None:
    engine, http = gw
    before = len(engine.received)
    body = {"model": MODEL, "messages": CONVS, "max_tokens": 3, **extra}
    r = http.post("/v1/chat/completions/batch", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert len(engine.received) == before  # nothing generated
