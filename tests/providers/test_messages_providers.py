"""The Messages API on hosted targets (the emulator): a coding agent's breakpoints
relayed to Anthropic as sent when they are valid, placed by the planner when they are
not, a rolling breakpoint read back turn after turn, other providers through their
adapters, and an alias that falls back from the local model to Anthropic."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from engines.tokenizer import ChatTokenizer
from tests.providers.conftest import KEY, Emulator, Gw, make_gateway

SONNET = "anthropic/claude-sonnet-4-5"
SYSTEM: Any = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1"},
    {
        "type": "text",
        "text": "You are a coding agent. " * 40,
        "cache_control": {"type": "ephemeral"},
    },
    {"type": "text", "text": "Work in small steps. " * 400, "cache_control": {"type": "ephemeral"}},
]
TOOLS: Any = [
    {
        "name": f"tool_{i}",
        "description": f"Tool number {i}. " * 20,
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}},
    }
    for i in range(4)
]


@pytest.fixture
def gw(emulator: Emulator, tokenizer: ChatTokenizer) -> Iterator[Gw]:
    emulator.admin("reset")
    yield from make_gateway(emulator, tokenizer)


def sdk(gw: Gw) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url="http://testserver", api_key=KEY, http_client=gw.http, max_retries=0
    )


def _marks(body: dict[str, Any]) -> list[str]:
    """Where the body sent upstream carries cache_control: system:i, tools:i, message:i."""
    out = [f"tools:{i}" for i, t in enumerate(body.get("tools", [])) if "cache_control" in t]
    out += [f"system:{i}" for i, b in enumerate(body.get("system", [])) if "cache_control" in b]
    for i, m in enumerate(body["messages"]):
        out += [f"message:{i}" for b in m["content"] if "cache_control" in b]
    return out


def test_valid_client_breakpoints_are_relayed_as_sent(gw: Gw) -> None:
    turn: Any = {"role": "user", "content": [
        {"type": "text", "text": "fix the bug", "cache_control": {"type": "ephemeral"}}
    ]}  # fmt: skip
    raw = sdk(gw).messages.with_raw_response.create(
        model=SONNET, max_tokens=16, system=SYSTEM, tools=TOOLS, messages=[turn]
    )
    assert raw.headers["x-vcache-breakpoints"] == "client"
    sent = gw.emulator.last_body()
    # the system blocks travel as one (the gateway's system prompt): its mark closes it
    assert _marks(sent) == ["system:0", "message:0"]
    m = raw.parse()
    assert m.usage.cache_creation_input_tokens and m.usage.cache_creation_input_tokens > 1024


def test_more_than_four_marks_are_placed_by_the_planner(gw: Gw) -> None:
    tools: Any = [{**t, "cache_control": {"type": "ephemeral"}} for t in TOOLS]
    turns: Any = []
    for i in range(4):
        mark = {"cache_control": {"type": "ephemeral"}}
        turns.append({"role": "user", "content": [{"type": "text", "text": f"q{i} " * 50, **mark}]})
        turns.append({"role": "assistant", "content": f"a{i}"})
    turns.append({"role": "user", "content": "last"})
    raw = sdk(gw).messages.with_raw_response.create(
        model=SONNET, max_tokens=16, system=SYSTEM, tools=tools, messages=turns
    )
    assert raw.headers["x-vcache-breakpoints"] == "planner"
    assert 0 < len(_marks(gw.emulator.last_body())) <= 4


def test_rolling_breakpoint_reads_the_previous_turn(gw: Gw) -> None:
    """A coding agent's loop: the mark moves to the last block of every new user turn;
    from the second turn on, nearly all of the previous turn's prompt is read back."""
    client = sdk(gw)
    history: Any = []
    last_prompt = 0
    for turn in range(5):
        for m in history:  # the previous turn's mark is dropped, as agents do
            if m["role"] == "user":
                m["content"] = [{k: v for k, v in b.items() if k != "cache_control"}
                                for b in m["content"]]  # fmt: skip
        history.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"t{turn}", "content": "output " * 200}
            if turn else {"type": "text", "text": "start the task"},
        ]})  # fmt: skip
        history[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
        if turn:  # a tool result answers the assistant's tool call before it
            history.insert(-1, {"role": "assistant", "content": [
                {"type": "tool_use", "id": f"t{turn}", "name": "tool_0", "input": {"path": "a"}}
            ]})  # fmt: skip
        m = client.messages.create(
            model=SONNET, max_tokens=8, system=SYSTEM, tools=TOOLS, messages=history
        )
        u = m.usage
        prompt = u.input_tokens + (u.cache_read_input_tokens or 0)
        prompt += u.cache_creation_input_tokens or 0
        if turn:
            assert (u.cache_read_input_tokens or 0) >= 0.95 * last_prompt, (turn, u)
        last_prompt = prompt
        history.append({"role": "assistant", "content": [b.model_dump() for b in m.content]})


@pytest.mark.parametrize(
    "target", ["openai/gpt-5", "gemini/gemini-2.5-flash", "deepseek/deepseek-chat"]
)
def test_other_providers_serve_messages_through_their_adapters(gw: Gw, target: str) -> None:
    m = sdk(gw).messages.create(
        model=target, max_tokens=16, system="You are brief.",
        messages=[{"role": "user", "content": "hello"}],
    )  # fmt: skip
    assert m.content[0].type == "text" and m.content[0].text
    assert m.usage.output_tokens > 0 and m.usage.input_tokens > 0


def test_alias_falls_back_from_the_local_model(gw: Gw) -> None:
    """The fake local model holds 512 tokens: a coding agent's prompt goes to Anthropic."""
    raw = sdk(gw).messages.with_raw_response.create(
        model="smart", max_tokens=16, system=SYSTEM,
        messages=[{"role": "user", "content": "hi"}],
    )  # fmt: skip
    assert raw.headers["x-vcache-target"] == SONNET
    assert raw.headers["x-vcache-fallback-from"] == "local"
    assert raw.parse().content[0].type == "text"
    short = sdk(gw).messages.with_raw_response.create(
        model="smart", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
    )
    assert short.headers["x-vcache-target"] == "local"
