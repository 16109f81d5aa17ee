"""``tool_choice: "required"`` streamed as it is decoded, and JSON that strict parsers
take: control characters a constrained model writes inside strings come out escaped."""

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
from gateway.core.pieces import ToolCallDelta
from gateway.service.json_text import JsonEscaper
from gateway.service.required_calls import RequiredCalls
from tests.settings import gateway_settings

MODEL = "vcache-demo"
ASK: list[Any] = [{"role": "user", "content": "weather in Paris and Rome?"}]
TOOLS: Any = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("get_weather", "get_time")
]
# two calls, with nesting, a brace inside a string, an escaped quote and raw controls
ANSWER = (
    '[{"name":"get_weather","parameters":{"city":"Pa\x01ris","at":[1,{"q":"}\\""}]}},'
    '{"name":"get_time","parameters":{"zone":"tab\there\nnewline"}}]'
)
WANT = [
    ("get_weather", {"city": "Pa\x01ris", "at": [1, {"q": '}"'}]}),
    ("get_time", {"zone": "tab\there\nnewline"}),
]


def _assembled(deltas: list[ToolCallDelta]) -> list[tuple[str, Any]]:
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for d in deltas:
        if d.name is not None:
            assert d.index not in names and d.id  # named once, with its id
            names[d.index] = d.name
        assert d.index in names  # no arguments before the name
        args[d.index] = args.get(d.index, "") + d.arguments
    return [(names[i], json.loads(args[i])) for i in sorted(names)]  # strict json.loads


@pytest.mark.parametrize("size", [1, 2, 3, 5, 8, 13, len(ANSWER)])
def test_calls_come_out_the_same_however_the_text_is_cut(size: int) -> None:
    reader = RequiredCalls()
    deltas = [d for i in range(0, len(ANSWER), size) for d in reader.feed(ANSWER[i : i + size])]
    assert _assembled(deltas) == WANT and reader.calls == 2


def test_a_name_goes_out_as_soon_as_it_is_complete() -> None:
    reader = RequiredCalls()
    assert reader.feed('[{"name":"get_wea') == []
    first = reader.feed('ther","parameters":{"ci')
    assert first[0].name == "get_weather" and first[0].id
    assert first[1:] == [ToolCallDelta(0, None, None, '{"ci')]  # arguments as they come


def test_arguments_before_the_name_wait_for_it() -> None:
    reader = RequiredCalls()
    deltas = reader.feed('[{"parameters":{"a":1},"name":"get_time"}]')
    assert [(d.name, d.arguments) for d in deltas] == [("get_time", '{"a":1}')]


@pytest.mark.parametrize("size", [1, 2, 4, 100])
def test_the_escaper_escapes_controls_inside_strings_only(size: int) -> None:
    text = '{"a":"x\x00y\\"\x1f","b":[\n"\t"]}'
    esc = JsonEscaper()
    out = "".join(esc.feed(text[i : i + size]) for i in range(0, len(text), size))
    assert out == '{"a":"x\\u0000y\\"\\u001f","b":[\n"\\t"]}'  # the newline outside stays
    assert json.loads(out) == {"a": 'x\x00y"\x1f', "b": ["\t"]}


@pytest.fixture
def sdk(demo_model: Path) -> Iterator[openai.OpenAI]:
    tokenizer = ChatTokenizer.from_pretrained(str(demo_model))
    engine = FakeEngine(tokenizer, max_model_len=2048, structured_reply=ANSWER)
    with TestClient(create_app(gateway_settings(grpc_port=None), [engine])) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)


def test_a_required_choice_streams_each_call_as_it_is_decoded(sdk: openai.OpenAI) -> None:
    stream: Any = sdk.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=200, tools=TOOLS, tool_choice="required", stream=True
    )
    chunks = [ch for chunk in stream for ch in chunk.choices]
    with_calls = [i for i, ch in enumerate(chunks) if ch.delta.tool_calls]
    assert len(with_calls) > 2 and with_calls[0] < len(chunks) // 2  # not held to the end
    assert chunks[-1].finish_reason == "tool_calls"
    deltas = [
        ToolCallDelta(d.index, d.id, d.function.name, d.function.arguments or "")
        for ch in chunks
        for d in ch.delta.tool_calls or []
    ]
    assert _assembled(deltas) == WANT


def test_a_required_choice_whole_gives_arguments_strict_parsers_take(sdk: openai.OpenAI) -> None:
    c = sdk.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=200, tools=TOOLS, tool_choice="required"
    )
    calls = c.choices[0].message.tool_calls or []
    got = [(t.function.name, json.loads(t.function.arguments)) for t in calls]  # type: ignore[union-attr]
    assert got == WANT and c.choices[0].finish_reason == "tool_calls"


def test_a_json_answer_is_json_strict_parsers_take(sdk: openai.OpenAI) -> None:
    c = sdk.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=200, response_format={"type": "json_object"}
    )
    assert json.loads(c.choices[0].message.content or "") == [
        {"name": n, "parameters": p} for n, p in WANT
    ]
