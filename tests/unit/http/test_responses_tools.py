"""The Responses API as agents use it, over an in-memory engine, driven by the official
``openai`` client: function tools, ``function_call`` / ``function_call_output`` items
(by ``previous_response_id`` and sent back whole), the stream's function-call events,
``text.format``, and what is refused by name.  The agents SDK on the real engine is in
tests/integration/test_agents_sdk.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.core.config import ApiKeyConfig, hash_api_key
from tests.settings import gateway_settings

MODEL = "vcache-demo"
KEY = "sk-responses"
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
INSTRUCTIONS = "You are a coding agent with tools. " * 20


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(str(demo_model))


def _gw(tokenizer: ChatTokenizer, tmp_path: Path, reply: str) -> Iterator[tuple[FakeEngine, Any]]:
    engine = FakeEngine(tokenizer, block_size=16, max_model_len=4096, reply=reply)
    log = {"path": str(tmp_path / "s.db"), "verify_reconstruction": True}
    keys = [ApiKeyConfig(sha256=hash_api_key(KEY), tenant="t", name="agent")]
    cfg = gateway_settings(grpc_port=None, session_log=log, api_keys=keys)
    with TestClient(create_app(cfg, [engine])) as http:
        sdk = openai.OpenAI(
            base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0
        )
        yield engine, sdk


@pytest.fixture
def tools_gw(tokenizer: ChatTokenizer, tmp_path: Path) -> Iterator[tuple[FakeEngine, Any]]:
    """An engine whose model answers with a Hermes tool call."""
    yield from _gw(tokenizer, tmp_path, CALL_TEXT)


@pytest.fixture
def text_gw(tokenizer: ChatTokenizer, tmp_path: Path) -> Iterator[tuple[FakeEngine, Any]]:
    yield from _gw(tokenizer, tmp_path, " fine")


def _call_len(tokenizer: ChatTokenizer) -> int:
    """Output tokens that hold exactly one call (the fake repeats its reply to the limit)."""
    return len(tokenizer.encode(CALL_TEXT))


def _prompt(engine: FakeEngine, tokenizer: ChatTokenizer, i: int = -1) -> str:
    return tokenizer.decode(list(engine.received[i].prompt_token_ids))


def test_function_call_round_trip_by_previous_response_id(
    tools_gw: tuple[FakeEngine, Any], tokenizer: ChatTokenizer
) -> None:
    engine, sdk = tools_gw
    r = sdk.responses.create(
        model=MODEL,
        instructions=INSTRUCTIONS,
        input="weather in Paris?",
        tools=[WEATHER],
        max_output_tokens=_call_len(tokenizer),
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) >= 1
    call = calls[0]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id and call.id.startswith("fc_")
    assert r.tools[0].name == "get_weather" and r.tool_choice == "auto"
    # the tools reached the engine through the chat template
    assert "get_weather" in _prompt(engine, tokenizer)
    out = [
        {"type": "function_call_output", "call_id": c.call_id, "output": "sunny, 21 C"}
        for c in calls
    ]
    again = sdk.responses.create(
        model=MODEL,
        instructions=INSTRUCTIONS,
        input=out,
        previous_response_id=r.id,
        tools=[WEATHER],
        max_output_tokens=8,
    )
    prompt = _prompt(engine, tokenizer)
    assert "sunny, 21 C" in prompt and "weather in Paris?" in prompt  # the history came back
    assert prompt.count('"city": "Paris"') >= 1  # the assistant's call, in the template's form
    assert again.usage is not None and again.usage.input_tokens_details.cached_tokens > 0


def test_whole_input_sent_back_continues_the_same_session(
    tools_gw: tuple[FakeEngine, Any], tokenizer: ChatTokenizer
) -> None:
    """An agent SDK that keeps its own history sends every item back: the function_call
    items map onto the same chat turn the log journaled, so the turn extends the session
    (same session name, the earlier prompt as cached prefix)."""
    engine, sdk = tools_gw
    ask: Any = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": "weather in Paris?"},
    ]
    first = sdk.responses.with_raw_response.create(
        model=MODEL, input=ask, tools=[WEATHER], max_output_tokens=_call_len(tokenizer)
    )
    r = first.parse()
    items = [o.model_dump(exclude_none=True) for o in r.output]
    outputs = [
        {"type": "function_call_output", "call_id": o.call_id, "output": "sunny"}
        for o in r.output
        if o.type == "function_call"
    ]
    second = sdk.responses.with_raw_response.create(
        model=MODEL, input=[*ask, *items, *outputs], tools=[WEATHER], max_output_tokens=8
    )
    session = first.headers["x-vcache-session"]
    assert session and second.headers["x-vcache-session"] == session
    assert (first.headers["x-vcache-session-kind"], second.headers["x-vcache-session-kind"]) == (
        "new",
        "found",
    )
    assert _prompt(engine, tokenizer, -1).startswith(_prompt(engine, tokenizer, -2)[:200])


def test_streamed_function_call_events(
    tools_gw: tuple[FakeEngine, Any], tokenizer: ChatTokenizer
) -> None:
    _, sdk = tools_gw
    kinds: list[str] = []
    seqs: list[int] = []
    deltas: dict[str, list[str]] = {}
    with sdk.responses.stream(
        model=MODEL,
        input="weather in Paris?",
        tools=[WEATHER],
        max_output_tokens=_call_len(tokenizer),
    ) as stream:
        for ev in stream:
            kinds.append(ev.type)
            seqs.append(ev.sequence_number)
            if ev.type == "response.function_call_arguments.delta":
                deltas.setdefault(ev.item_id, []).append(ev.delta)
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed" and seqs == list(range(len(seqs)))
    assert (
        "response.output_item.added" in kinds and "response.function_call_arguments.done" in kinds
    )
    call = next(o for o in final.output if o.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.arguments == "".join(deltas[call.id])  # streamed as decoded, in pieces
    # the stored response is the streamed one
    assert sdk.responses.retrieve(final.id).output[0].type == final.output[0].type


def test_forced_tool_then_text(text_gw: tuple[FakeEngine, Any]) -> None:
    """``tool_choice`` naming a function forces that call (constrained JSON), and the
    next turn with the tool's output answers in text."""
    engine, sdk = text_gw
    r = sdk.responses.create(
        model=MODEL,
        input="weather?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=64,
    )
    assert [o.type for o in r.output] == ["function_call"]
    assert engine.received[-1].sampling.structured is not None
    call = r.output[0]
    assert r.tool_choice.name == "get_weather"
    done = sdk.responses.create(
        model=MODEL,
        previous_response_id=r.id,
        tools=[WEATHER],
        max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "rain"}],
    )
    assert [o.type for o in done.output] == ["message"] and done.output_text


def test_text_format_json_schema(text_gw: tuple[FakeEngine, Any]) -> None:
    engine, sdk = text_gw
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string"}},
        "required": ["answer"],
    }
    fmt: Any = {"format": {"type": "json_schema", "name": "reply", "schema": schema}}
    r = sdk.responses.create(model=MODEL, input="answer", text=fmt, max_output_tokens=32)
    assert engine.received[-1].sampling.structured is not None
    assert json.loads(r.output_text) == {"answer": "fake"}
    assert r.text.format.type == "json_schema"
    j = sdk.responses.create(
        model=MODEL, input="answer", text={"format": {"type": "json_object"}}, max_output_tokens=32
    )
    assert isinstance(json.loads(j.output_text), dict)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"background": True}, "background"),
        ({"text": {"format": {"type": "json_schema"}}}, "text"),
        ({"tools": True}, "tools"),  # found by the contract fuzzer: was a 500
        (
            {
                "input": [
                    {
                        "type": "function_call",
                        "call_id": "c",
                        "name": "f",
                        "arguments": "",
                        "status": {"x": 1},
                    }
                ]
            },
            "input",
        ),
    ],
)
def test_what_cannot_be_served_is_refused_by_name(
    text_gw: tuple[FakeEngine, Any], body: dict[str, Any], param: str
) -> None:
    _, sdk = text_gw
    with pytest.raises(openai.BadRequestError) as err:
        sdk.responses.create(**{"model": MODEL, "input": "hi", **body})
    error = err.value.body
    assert isinstance(error, dict)
    assert str(error.get("param", "")).startswith(param), error


@pytest.mark.parametrize("header", ["session-id", "thread-id", "x-claude-code-session-id"])
def test_an_agents_own_session_header_names_the_session(
    text_gw: tuple[FakeEngine, Any], header: str
) -> None:
    """Codex sends ``session-id`` / ``thread-id``, Claude Code its own header: each names
    the session on the Responses and chat APIs as ``x-vcache-session`` does."""
    _, sdk = text_gw
    r = sdk.responses.with_raw_response.create(
        model=MODEL, input="hi", max_output_tokens=2, extra_headers={header: "agent-7"}
    )
    assert r.headers["x-vcache-session"] == "agent-7"
    c = sdk.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_headers={header: "agent-8"},
    )
    assert c.headers["x-vcache-session"] == "agent-8"
    assert c.headers["x-vcache-session-kind"] == "named"
    bad = sdk.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_headers={header: "not a name!"},
    )
    assert bad.headers["x-vcache-session"] != "not a name!"  # ignored: found or started
    assert bad.headers["x-vcache-session-kind"] in ("found", "new")


def test_a_response_and_its_stream_validate_as_the_openai_sdks_types(
    tools_gw: tuple[FakeEngine, Any], tokenizer: ChatTokenizer
) -> None:
    """What the gateway answers is today's Response: the SDK's own model validates it
    strictly (not only the lenient construct a ``create`` call does), the usage's
    ``input_tokens_details.cache_write_tokens`` included, whole and as the stream's
    ``response.completed``."""
    from openai.types.responses import Response

    _, sdk = tools_gw
    body = {"model": MODEL, "input": "Weather in Paris?", "tools": [WEATHER]}
    n = _call_len(tokenizer)
    raw = sdk.responses.with_raw_response.create(**body, max_output_tokens=n)
    whole = Response.model_validate(json.loads(raw.text))
    assert whole.usage is not None and whole.usage.input_tokens_details.cache_write_tokens == 0
    with sdk.responses.stream(**body, max_output_tokens=n) as stream:
        events = [e for e in stream if e.type == "response.completed"]
    (done,) = events
    streamed = Response.model_validate(done.response.model_dump(mode="json"))
    assert streamed.usage is not None and streamed.usage.input_tokens == whole.usage.input_tokens
