"""Tool calls in each provider's wire format: rendered turns, parsed answers, streams."""

from __future__ import annotations

import json

from engines.providers.anthropic import AnthropicAdapter
from engines.providers.base import CacheDirectives, ChatCall, ToolCall, ToolCallPart, Turn
from engines.providers.gemini import GeminiAdapter
from engines.providers.openai import OpenAIAdapter
from engines.sse import ServerSentEvent

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALLS = (ToolCall("c1", "f", '{"x": 1}'), ToolCall("c2", "f", "not json"))
CALL = ChatCall(
    model="m",
    tools=(TOOL,),
    turns=(
        Turn("user", "go"),
        Turn("assistant", "", CALLS),
        Turn("tool", '{"ok": true}', tool_call_id="c1"),
        Turn("tool", "plain", tool_call_id="c2"),
    ),
)


def _body(r: bytes) -> dict:  # type: ignore[type-arg]
    out: dict = json.loads(r)  # type: ignore[type-arg]
    return out


def test_openai_keeps_calls_and_results_as_messages() -> None:
    r = OpenAIAdapter().render(CALL, CacheDirectives())
    msgs = _body(r.body)["messages"]
    assert msgs[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "not json"}},
        ],
    }
    assert msgs[2] == {"role": "tool", "tool_call_id": "c1", "content": '{"ok": true}'}
    ends = [r.segment_ends[f"message:{i}"] for i in range(4)]
    assert ends == sorted(ends) and len(set(ends)) == 4


def test_anthropic_results_share_one_user_message_and_the_marker_ends_the_turn() -> None:
    cache = CacheDirectives(breakpoints=("message:1", "message:3"))
    r = AnthropicAdapter().render(CALL, cache)
    msgs = _body(r.body)["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
    uses = msgs[1]["content"]
    assert [b["type"] for b in uses] == ["tool_use", "tool_use"]  # no empty text block
    assert uses[0]["input"] == {"x": 1} and uses[1]["input"] == {"arguments": "not json"}
    assert "cache_control" in uses[1] and "cache_control" not in uses[0]
    results = msgs[2]["content"]
    assert [b["tool_use_id"] for b in results] == ["c1", "c2"]
    assert "cache_control" in results[1] and "cache_control" not in results[0]


def test_anthropic_tool_choice_in_its_terms_and_not_forced_on_a_warm() -> None:
    named = {"type": "function", "function": {"name": "f"}}
    a = AnthropicAdapter()
    for choice, want in (
        ("auto", {"type": "auto"}),
        ("required", {"type": "any"}),
        (named, {"type": "tool", "name": "f"}),
    ):
        call = ChatCall(model="m", turns=(Turn("user", "x"),), tools=(TOOL,), tool_choice=choice)
        assert _body(a.render(call, CacheDirectives()).body)["tool_choice"] == want
        warm = _body(a.render(call, CacheDirectives(warm=True)).body)
        assert warm.get("tool_choice") == (want if choice == "auto" else None)


def test_gemini_names_each_response_and_groups_them() -> None:
    contents = _body(GeminiAdapter().render(CALL, CacheDirectives()).body)["contents"]
    assert [c["role"] for c in contents] == ["user", "model", "user"]
    assert contents[1]["parts"][0] == {"functionCall": {"name": "f", "args": {"x": 1}}}
    assert contents[2]["parts"] == [
        {"functionResponse": {"name": "f", "response": {"ok": True}}},
        {"functionResponse": {"name": "f", "response": {"content": "plain"}}},
    ]


def test_answers_parse_to_calls_and_tool_calls_finish() -> None:
    o = OpenAIAdapter().parse(
        {
            "choices": [
                {
                    "message": {
                        "content": None,
                        "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{}"}}],
                    },
                    "finish_reason": "tool_calls",
                }
            ]
        }
    )
    assert o.tool_calls == (ToolCall("a", "f", "{}"),) and o.finish_reason == "tool_calls"
    a = AnthropicAdapter().parse(
        {
            "content": [
                {"type": "text", "text": "hm"},
                {"type": "tool_use", "id": "t", "name": "f", "input": {"x": 1}},
            ],
            "stop_reason": "tool_use",
        }
    )
    assert a.text == "hm" and a.finish_reason == "tool_calls"
    assert a.tool_calls[0].id == "t" and json.loads(a.tool_calls[0].arguments) == {"x": 1}
    g = GeminiAdapter().parse(
        {
            "candidates": [
                {
                    "content": {"parts": [{"functionCall": {"name": "f", "args": {}}}]},
                    "finishReason": "STOP",
                }
            ]
        }
    )
    assert g.finish_reason == "tool_calls" and g.tool_calls[0].id.startswith("call_")


def _events(*data: dict) -> list[ServerSentEvent]:  # type: ignore[type-arg]
    return [ServerSentEvent(data=json.dumps(d)) for d in data]


def test_anthropic_stream_numbers_calls_after_a_text_block() -> None:
    p = AnthropicAdapter().stream_parser()
    parts = []
    for e in _events(
        {"type": "message_start", "message": {"usage": {"input_tokens": 3}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "ok"}},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '{"x"'},
        },
        {
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": ": 1}"},
        },
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use"},
            "usage": {"output_tokens": 5},
        },
    ):
        parts += p.feed(e)
    assert parts[0].text == "ok"
    assert [c for d in parts for c in d.tool_calls] == [
        ToolCallPart(0, "t", "f"),
        ToolCallPart(0, arguments='{"x"'),
        ToolCallPart(0, arguments=": 1}"),
    ]
    assert parts[-1].finish_reason == "tool_calls"


def test_openai_stream_passes_call_parts_through() -> None:
    p = OpenAIAdapter().stream_parser()
    head = {"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": ""}}
    out = p.feed(_events({"choices": [{"delta": {"tool_calls": [head]}}]})[0])
    assert out[0].tool_calls == (ToolCallPart(0, "a", "f", ""),)
