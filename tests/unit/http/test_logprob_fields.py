"""vLLM's logprob and token-id fields on the local target: ``prompt_logprobs`` (chat and
text), echo with logprobs (the prompt's tokens first, the first with none) and
``max_tokens: 0`` scoring, ``return_tokens_as_token_ids``, chat's ``return_token_ids``
(whole and streamed), and ``stream_options.continuous_usage_stats``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine

MODEL = "vcache-demo"
ASK = [{"role": "user", "content": "say hello"}]

Gateway = tuple[FakeEngine, TestClient]


def _post(http: TestClient, path: str, **body: Any) -> dict[str, Any]:
    r = http.post(path, json={"model": MODEL, "max_tokens": 3, **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


def _events(http: TestClient, path: str, **body: Any) -> list[dict[str, Any]]:
    body = {"model": MODEL, "max_tokens": 3, "stream": True, **body}
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        lines = [x for x in r.iter_lines() if x.startswith("data: {")]
    return [json.loads(x[6:]) for x in lines]


def test_prompt_logprobs_one_per_prompt_token_the_first_none(gw: Gateway) -> None:
    engine, http = gw
    out = _post(http, "/v1/completions", prompt="hello there world", prompt_logprobs=2)
    ids = list(engine.received[-1].prompt_token_ids)
    assert engine.received[-1].sampling.prompt_logprobs == 2
    steps = out["choices"][0]["prompt_logprobs"]
    assert len(steps) == len(ids) and steps[0] is None
    for token_id, step in zip(ids[1:], steps[1:], strict=True):
        assert step[str(token_id)]["rank"] == 2 and step[str(token_id)]["logprob"] == -1.5
        assert {v["rank"] for k, v in step.items() if k != str(token_id)} == {1, 2}
    chat = _post(http, "/v1/chat/completions", messages=ASK, prompt_logprobs=0)
    sent = engine.received[-1].prompt_token_ids
    assert len(chat["prompt_logprobs"]) == len(sent) and chat["prompt_logprobs"][0] is None
    assert _post(http, "/v1/chat/completions", messages=ASK)["prompt_logprobs"] is None


def test_echo_with_logprobs_scores_the_prompt_first(gw: Gateway) -> None:
    engine, http = gw
    tok = engine.tokenizer
    prompt = "hello there world"
    ids = tok.encode(prompt)
    out = _post(http, "/v1/completions", prompt=prompt, echo=True, logprobs=1)
    assert engine.received[-1].sampling.prompt_logprobs == 1  # as many as the answer's
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3  # the prompt's, then the three generated
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1 : len(ids)] == [-1.5] * (len(ids) - 1)
    assert "".join(lp["tokens"][: len(ids)]) == tok.decode(ids)
    assert out["choices"][0]["text"].startswith(prompt)
    assert lp["text_offset"][len(ids)] == len("".join(lp["tokens"][: len(ids)]))
    scored = _post(http, "/v1/completions", prompt=prompt, echo=True, logprobs=0, max_tokens=0)
    choice = scored["choices"][0]
    assert choice["text"] == prompt and len(choice["logprobs"]["tokens"]) == len(ids)


def test_tokens_as_token_ids(gw: Gateway) -> None:
    _, http = gw
    out = _post(
        http,
        "/v1/completions",
        prompt="hi",
        logprobs=1,
        return_tokens_as_token_ids=True,
        return_token_ids=True,
    )
    choice = out["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    tops = choice["logprobs"]["top_logprobs"]
    assert all(f"token_id:{t}" in top for t, top in zip(choice["token_ids"], tops, strict=True))
    chat = _post(
        http,
        "/v1/chat/completions",
        messages=ASK,
        logprobs=True,
        top_logprobs=1,
        return_tokens_as_token_ids=True,
    )
    content = chat["choices"][0]["logprobs"]["content"]
    assert content and all(c["token"].startswith("token_id:") for c in content)


def test_chat_token_ids_whole_and_streamed(gw: Gateway) -> None:
    engine, http = gw
    out = _post(http, "/v1/chat/completions", messages=ASK, return_token_ids=True)
    sent = list(engine.received[-1].prompt_token_ids)
    assert out["prompt_token_ids"] == sent
    text = out["choices"][0]["message"]["content"]
    assert engine.tokenizer.decode(out["choices"][0]["token_ids"]) == text
    plain = _post(http, "/v1/chat/completions", messages=ASK)
    assert plain["prompt_token_ids"] is None is plain["choices"][0]["token_ids"]  # vLLM's nulls
    events = _events(http, "/v1/chat/completions", messages=ASK, return_token_ids=True)
    assert events[0]["prompt_token_ids"] == sent
    assert all("prompt_token_ids" not in e for e in events[1:])
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert streamed == out["choices"][0]["token_ids"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_on_every_chunk(gw: Gateway, path: str) -> None:
    engine, http = gw
    where: dict[str, Any] = {"messages": ASK} if "chat" in path else {"prompt": "say hello"}
    options = {"include_usage": True, "continuous_usage_stats": True}
    alone = _events(http, path, stream_options={"continuous_usage_stats": True}, **where)
    assert all(e.get("usage") is None for e in alone)  # vLLM's: only with include_usage
    events = _events(http, path, stream_options=options, **where)
    prompt = engine.received[-1].num_prompt_tokens
    assert all(e["usage"] is not None for e in events)
    assert all(e["usage"]["prompt_tokens"] == prompt for e in events)
    done = [e["usage"]["completion_tokens"] for e in events]
    assert done == sorted(done) and done[-1] == 3  # counted up to the final usage
    assert all(e["usage"]["total_tokens"] == prompt + d for e, d in zip(events, done, strict=True))
    plain = _events(http, path, **where)
    assert all(e.get("usage") is None for e in plain)
