"""Text completions as OpenAI defines them: several prompts in one request (strings or
token lists; choice i*n+j is prompt i's sample j), echo, and best_of refused by name."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine

MODEL = "vcache-demo"
REPLY = "hello from the fake engine"


def _ask(http: TestClient, **body: Any) -> dict[str, Any]:
    r = http.post("/v1/completions", json={"model": MODEL, "max_tokens": 3, **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_several_prompts_answer_n_choices_each_in_openais_order(
    gw: tuple[FakeEngine, TestClient],
) -> None:
    engine, http = gw
    tok = engine.tokenizer
    prompts = ["first prompt", "the second one here", "third"]
    before = len(engine.received)
    out = _ask(http, prompt=prompts, n=2)
    sent = engine.received[before:]
    assert sorted(r.prompt_token_ids for r in sent) == sorted(
        tuple(tok.encode(p)) for p in prompts
    )  # one engine request per prompt
    assert [c["index"] for c in out["choices"]] == list(range(6))
    want = tok.decode(tok.encode(REPLY)[:3])
    assert all(c["text"] == want for c in out["choices"])
    usage = out["usage"]
    assert usage["prompt_tokens"] == sum(len(tok.encode(p)) for p in prompts)
    assert usage["completion_tokens"] == 6 * 3
    assert usage["total_tokens"] == usage["prompt_tokens"] + 18


def test_token_list_prompts_and_a_stream(gw: tuple[FakeEngine, TestClient]) -> None:
    _, http = gw
    body = {
        "model": MODEL,
        "prompt": [[5, 6, 7], [8, 9]],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts: dict[int, str] = {}
    finished = set()
    for e in events:
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                finished.add(c["index"])
    assert set(texts) == finished == {0, 1}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["prompt_tokens"] == 5
    assert events[-1]["usage"]["completion_tokens"] == 6


def test_echo_puts_the_prompt_before_each_answer(gw: tuple[FakeEngine, TestClient]) -> None:
    engine, http = gw
    tok = engine.tokenizer
    answer = tok.decode(tok.encode(REPLY)[:3])
    out = _ask(http, prompt=["say it", "again"], echo=True)
    assert [c["text"] for c in out["choices"]] == ["say it" + answer, "again" + answer]
    out = _ask(http, prompt=[5, 6, 7], echo=True, n=2)
    assert [c["text"] for c in out["choices"]] == [tok.decode([5, 6, 7]) + answer] * 2


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"best_of": 3}, "best_of", "unsupported_parameter"),
        ({"max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "invalid_value"),
        ({"prompt_logprobs": 21}, "prompt_logprobs", "invalid_value"),
        ({"prompt": ["a"] * 129}, "prompt", "invalid_value"),
        ({"prompt": [[1], [1, 10**9]]}, "prompt[1][1]", "invalid_value"),
        ({"prompt": ["fine", ""]}, "prompt[1]", "invalid_value"),
    ],
)
def test_what_is_refused_is_named(
    gw: tuple[FakeEngine, TestClient], extra: dict[str, Any], param: str, code: str
) -> None:
    engine, http = gw
    before = len(engine.received)
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code)
    assert len(engine.received) == before  # no prompt of it was generated


def test_best_of_one_is_the_default(gw: tuple[FakeEngine, TestClient]) -> None:
    _, http = gw
    assert len(_ask(http, prompt="x", best_of=1)["choices"]) == 1


def test_return_token_ids_gives_each_choice_its_prompt_and_output_ids(
    gw: tuple[FakeEngine, TestClient],
) -> None:
    engine, http = gw
    tok = engine.tokenizer
    out = _ask(http, prompt=["one prompt", "another"], n=2, return_token_ids=True)
    for c in out["choices"]:
        prompt = ["one prompt", "another"][c["index"] // 2]
        assert c["prompt_token_ids"] == tok.encode(prompt)
        assert c["token_ids"] == tok.encode(REPLY)[:3] and tok.decode(c["token_ids"]) == c["text"]
    plain = _ask(http, prompt="x")
    assert plain["choices"][0]["token_ids"] is None is plain["choices"][0]["prompt_token_ids"]


def test_return_token_ids_streams_the_prompt_ids_first_and_output_ids_as_deltas(
    gw: tuple[FakeEngine, TestClient],
) -> None:
    engine, http = gw
    tok = engine.tokenizer
    body = {"model": MODEL, "prompt": "stream me", "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/completions", json={**body, "return_token_ids": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [c for e in events for c in e["choices"]]
    assert choices[0]["prompt_token_ids"] == tok.encode("stream me")
    assert all(c.get("prompt_token_ids") is None for c in choices[1:])
    assert [t for c in choices for t in c["token_ids"]] == tok.encode(REPLY)[:3]
