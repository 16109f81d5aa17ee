"""vLLM's sampling extensions reach the local engine as vLLM's own server passes them,
validated with vLLM's bounds; vLLM parameters vcache does not do are refused by name
unless they carry vLLM's default."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.base import Structured
from engines.fake import FakeEngine
from gateway.core.schemas import ChatCompletionRequest
from gateway.sessions.render import request_config

MODEL = "vcache-demo"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TEXT = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
EXTENSIONS: dict[str, Any] = {
    "top_k": 7,
    "min_p": 0.05,
    "repetition_penalty": 1.3,
    "min_tokens": 2,
    "stop_token_ids": [3, 4],
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "spaces_between_special_tokens": False,
    "bad_words": ["never"],
    "allowed_token_ids": [10, 11, 12],
}


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)]
)
def test_every_extension_reaches_the_engine(
    gw: tuple[FakeEngine, TestClient], path: str, body: dict[str, Any]
) -> None:
    engine, http = gw
    r = http.post(path, json={**body, **EXTENSIONS})
    assert r.status_code == 200, r.text
    s = engine.received[-1].sampling
    assert (s.top_k, s.min_p, s.repetition_penalty, s.min_tokens) == (7, 0.05, 1.3, 2)
    assert s.stop_token_ids == (3, 4) and s.bad_words == ("never",)
    assert s.allowed_token_ids == (10, 11, 12)
    assert s.include_stop_str_in_output and not s.skip_special_tokens
    assert not s.spaces_between_special_tokens


def test_defaults_ask_for_nothing(gw: tuple[FakeEngine, TestClient]) -> None:
    engine, http = gw
    assert http.post("/v1/chat/completions", json={**CHAT, "top_k": -1}).status_code == 200
    s = engine.received[-1].sampling
    assert (s.top_k, s.min_p, s.repetition_penalty, s.min_tokens) == (0, 0.0, 1.0, 0)
    assert s.allowed_token_ids is None and s.skip_special_tokens


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"top_k": -2}, "top_k"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5}, "min_tokens"),  # past max_tokens (4)
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, 10**7]}, "allowed_token_ids[1]"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ({"bad_words": [""]}, "bad_words[0]"),
    ],
)
def test_bounds_as_vllm_checks_them(
    gw: tuple[FakeEngine, TestClient], extra: dict[str, Any], param: str
) -> None:
    engine, http = gw
    before = len(engine.received)
    r = http.post("/v1/chat/completions", json={**CHAT, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "invalid_value"
    assert len(engine.received) == before  # nothing was generated


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"use_beam_search": True}, "use_beam_search"),
        ({"return_token_offsets": True}, "return_token_offsets"),
        ({"logprob_token_ids": [3]}, "logprob_token_ids"),
        ({"documents": [{"text": "d"}]}, "documents"),
        ({"thinking_token_budget": 10}, "thinking_token_budget"),
        ({"return_prompt_text": True}, "return_prompt_text"),
        ({"priority": 3}, "priority"),
        ({"kv_transfer_params": {"do_remote_prefill": True}}, "kv_transfer_params"),
    ],
)
def test_vllm_parameters_not_done_are_refused_by_name(
    gw: tuple[FakeEngine, TestClient], extra: dict[str, Any], param: str
) -> None:
    _, http = gw
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)):
        r = http.post(path, json={**body, **extra})
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == "unsupported_parameter"
        assert f"'{param}' is a vLLM parameter" in err["message"]
    r = http.post("/v1/chat/completions", json={**CHAT, "priority": 3})
    assert "x-vcache-priority" in r.json()["error"]["message"]


def test_their_defaults_are_accepted(gw: tuple[FakeEngine, TestClient]) -> None:
    _, http = gw
    defaults = {
        "use_beam_search": False,
        "length_penalty": 1.0,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "priority": 0,
        "return_token_ids": False,
        "chat_template_kwargs": {},
        "prompt_logprobs": None,
    }
    assert http.post("/v1/chat/completions", json={**CHAT, **defaults}).status_code == 200


def test_the_log_header_keeps_the_extensions_a_request_sets() -> None:
    plain = ChatCompletionRequest.model_validate(CHAT)
    assert "vllm" not in request_config(plain, None)  # headers written before stay the same
    asked = ChatCompletionRequest.model_validate({**CHAT, "min_tokens": 2, "top_k": 0})
    assert request_config(asked, None)["vllm"] == {"min_tokens": 2}


@pytest.mark.parametrize(
    ("given", "want"),
    [
        ({"choice": ["yes", "no"]}, Structured(choice=("yes", "no"))),
        ({"regex": "[a-z]{3}"}, Structured(regex="[a-z]{3}")),
        ({"grammar": 'root ::= "a" | "b"'}, Structured(grammar='root ::= "a" | "b"')),
        (
            {"json": {"type": "object", "b": 1, "a": 2}},
            Structured(json_schema='{"a":2,"b":1,"type":"object"}'),
        ),
        ({"json": '{"type": "string"}'}, Structured(json_schema='{"type":"string"}')),
        (
            {"json_object": True, "disable_any_whitespace": False},
            Structured(json_object=True, any_whitespace=True),
        ),
        ({"structural_tag": '{"type": "x"}'}, Structured(structural_tag='{"type": "x"}')),
    ],
)
def test_structured_outputs_reach_the_engine(
    gw: tuple[FakeEngine, TestClient], given: dict[str, Any], want: Structured
) -> None:
    engine, http = gw
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)):
        r = http.post(path, json={**body, "structured_outputs": given})
        assert r.status_code == 200, r.text
        assert engine.received[-1].sampling.structured == want


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        (
            {"structured_outputs": {"regex": "a", "backend": "outlines"}},
            "structured_outputs.backend",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
        ),
    ],
)
def test_structured_outputs_take_one_constraint(
    gw: tuple[FakeEngine, TestClient], extra: dict[str, Any], param: str
) -> None:
    _, http = gw
    r = http.post("/v1/chat/completions", json={**CHAT, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_a_clients_cache_salt_is_kept_inside_its_tenants(gw: tuple[FakeEngine, TestClient]) -> None:
    engine, http = gw
    salts = []
    for extra in ({}, {"cache_salt": "user-1"}, {"cache_salt": "user-2"}):
        assert http.post("/v1/chat/completions", json={**CHAT, **extra}).status_code == 200
        salts.append(engine.received[-1].cache_salt)
    assert salts[0] == "tenant:default" and len(set(salts)) == 3
    assert all(s is not None and s.startswith(salts[0]) for s in salts)  # never replaced
    assert engine.received[-1].tenant == "default"  # fairness still counts the tenant
    r = http.post("/v1/chat/completions", json={**CHAT, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_chat_echo_repeats_the_assistant_message_being_continued(
    gw: tuple[FakeEngine, TestClient],
) -> None:
    _, http = gw
    said = "An apple a day keeps"
    going_on = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": said}]
    body = {
        **CHAT,
        "messages": going_on,
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    echoed = http.post("/v1/chat/completions", json={**body, "echo": True}).json()
    plain = http.post("/v1/chat/completions", json=body).json()
    text = plain["choices"][0]["message"]["content"]
    assert echoed["choices"][0]["message"]["content"] == said + text
    with http.stream(
        "POST", "/v1/chat/completions", json={**body, "echo": True, "stream": True}
    ) as r:
        first = next(x for x in r.iter_lines() if x.startswith("data: {"))
    assert json.loads(first[6:])["choices"][0]["delta"]["content"] == said
    # nothing to repeat when the last message is not the assistant's
    asked = http.post("/v1/chat/completions", json={**CHAT, "echo": True}).json()
    assert asked["choices"][0]["message"]["content"] == text
