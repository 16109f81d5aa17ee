"""Tool calls through hosted providers: each provider's wire format both ways.

The emulator answers in each provider's own shape (OpenAI ``tool_calls``,
Anthropic ``tool_use`` blocks, Gemini ``functionCall`` parts) and checks
the tool results sent back the way the providers do (a result must answer
a call of the turn before; Gemini counts them).  Through the gateway the
client sees OpenAI's shape, whole or streamed, and the conversation that
goes on with the results is served and rebuilt byte for byte from the
session log.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, cast

import pytest
from openai.types.chat import ChatCompletionToolParam

from manifest.sessionlog import scoped_session
from tests.providers.conftest import KEY, MODELS, Gw

SYSTEM = "You look things up in the vcache manual.\n" * 40
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SECTION = {
    "type": "function",
    "function": {
        "name": "lookup_section",
        "description": "A manual section by number",
        "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}},
    },
}
PROVIDERS = list(MODELS)


def _ask(gw: Gw, provider: str, session: str, **body: Any) -> dict[str, Any]:
    h = {"authorization": f"Bearer {KEY}", "x-vcache-session": session}
    body = {"model": f"{provider}/{MODELS[provider]}", "max_tokens": 8, **body}
    r = gw.http.post("/v1/chat/completions", headers=h, json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


@pytest.mark.parametrize("provider", PROVIDERS)
def test_calls_come_back_in_openais_shape_and_the_results_go_on(gw: Gw, provider: str) -> None:
    session = f"relay-{provider}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "weather in Oslo, and section 3?"},
    ]
    first = _ask(gw, provider, session, messages=messages, tools=[WEATHER, SECTION])
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "lookup_section"]
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)
    args = json.loads(calls[0]["function"]["arguments"])
    assert isinstance(args["city"], str) and isinstance(args["days"], int)

    # the results, one per call: the provider accepts them only if relayed in its shape
    messages.append({"role": "assistant", "content": None, "tool_calls": calls})
    messages += [
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"temp_c": 4}'},
        {"role": "tool", "tool_call_id": calls[1]["id"], "content": "Section 3: warming."},
    ]
    second = _ask(gw, provider, session, messages=messages, tools=[WEATHER, SECTION])
    choice = second["choices"][0]
    assert choice["finish_reason"] in ("stop", "length") and choice["message"]["content"]
    assert "tool_calls" not in choice["message"]

    log = gw.log()
    rows = log.store.requests(scoped_session("t", session))
    assert len(rows) == 2
    received = [r for r in gw.emulator.received() if r["path"] != "/v1beta/cachedContents"]
    assert [row.sha256 for row in rows] == [r["sha256"] for r in received]
    for row in rows:
        _, data = log.rebuild(row.session_id, row.seq)
        assert hashlib.sha256(data).hexdigest() == row.sha256


@pytest.mark.parametrize("provider", PROVIDERS)
def test_streamed_calls_add_up_to_the_whole_answer(gw: Gw, provider: str) -> None:
    stream = gw.client().chat.completions.create(
        model=f"{provider}/{MODELS[provider]}",
        messages=[{"role": "user", "content": "weather in Oslo?"}],
        tools=[cast(ChatCompletionToolParam, WEATHER)],
        stream=True,
        max_tokens=8,
    )
    ids: dict[int, str] = {}
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            for d in c.delta.tool_calls or []:
                if d.id:
                    ids[d.index] = d.id
                if d.function and d.function.name:
                    names[d.index] = d.function.name
                if d.function and d.function.arguments:
                    arguments[d.index] = arguments.get(d.index, "") + d.function.arguments
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert names == {0: "get_weather"} and ids[0]
    assert set(json.loads(arguments[0])) == {"city", "days"}


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_named_tool_choice_is_forced_in_each_providers_terms(gw: Gw, provider: str) -> None:
    choice = {"type": "function", "function": {"name": "lookup_section"}}
    out = _ask(
        gw,
        provider,
        f"forced-{provider}",
        messages=[{"role": "user", "content": "hi"}],
        tools=[WEATHER, SECTION],
        tool_choice=choice,
    )
    calls = out["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["lookup_section"]
    sent = gw.emulator.last_body()
    expected = {
        "openai": ("tool_choice", choice),
        "deepseek": ("tool_choice", choice),
        "anthropic": ("tool_choice", {"type": "tool", "name": "lookup_section"}),
        "gemini": (
            "toolConfig",
            {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["lookup_section"]}},
        ),
    }[provider]
    assert sent[expected[0]] == expected[1]


@pytest.mark.parametrize("provider", PROVIDERS)
def test_tool_choice_none_answers_in_text(gw: Gw, provider: str) -> None:
    out = _ask(
        gw,
        provider,
        f"none-{provider}",
        messages=[{"role": "user", "content": "hi"}],
        tools=[WEATHER],
        tool_choice="none",
    )
    assert out["choices"][0]["message"]["content"]
    assert "tool_calls" not in out["choices"][0]["message"]


def test_provider_answers_are_timed_by_model_and_target(gw: Gw) -> None:
    stream = gw.client().chat.completions.create(
        model=f"anthropic/{MODELS['anthropic']}",
        messages=[{"role": "user", "content": "hello"}],
        stream=True,
        max_tokens=6,
    )
    assert sum(1 for c in stream for ch in c.choices if ch.delta.content) == 6
    text = gw.http.get("/metrics").text
    labels = f'model="{MODELS["anthropic"]}",replica="",target="anthropic/{MODELS["anthropic"]}"'
    assert f'vcache_ttft_seconds_count{{endpoint="chat",{labels}}} 1.0' in text
    assert f"vcache_inter_token_latency_seconds_count{{{labels}}} 5.0" in text  # 6 words, 5 gaps
