"""The Messages API on hosted targets (the emulator): a coding agent's breakpoints
relayed to Anthropic as sent when they are valid, placed by the planner when they are
not, a rolling breakpoint read back turn after turn, other providers through their
adapters, and an alias that falls back from the local model to Anthropic."""

from __future__ import annotations

import copy
import hashlib
import json
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


def _rebuilt(gw: Gw, target: str) -> int:
    """How many requests sent to ``target`` there are; each rebuilds from the log to the
    bytes that were sent."""
    log = gw.log()
    rows = [r for r in log.store.requests() if r.target == target]
    for row in rows:
        _, data = log.rebuild(row.session_id, row.seq)
        assert hashlib.sha256(data).hexdigest() == row.sha256, row.request_id
    return len(rows)


def _marks(body: dict[str, Any]) -> list[str]:
    """Where the body sent upstream carries cache_control: system:i, tools:i, message:i."""
    out = [f"tools:{i}" for i, t in enumerate(body.get("tools", [])) if "cache_control" in t]
    out += [f"system:{i}" for i, b in enumerate(body.get("system", [])) if "cache_control" in b]
    for i, m in enumerate(body["messages"]):
        out += [f"message:{i}" for b in m["content"] if "cache_control" in b]
    return out


def test_valid_client_breakpoints_are_relayed_as_sent(gw: Gw) -> None:
    turn: Any = {
        "role": "user",
        "content": [
            {"type": "text", "text": "fix the bug", "cache_control": {"type": "ephemeral"}}
        ],
    }
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


def test_coding_agent_reads_the_previous_turn_on_anthropic(gw: Gw) -> None:
    """A coding agent's loop on an Anthropic target: three system blocks (two marked),
    twelve tools, thinking and context_management, the mark moving to the last block of
    every new user turn, twenty tool turns; from the second turn on at least 95% of the
    previous turn's prompt is read back, and every request rebuilds byte for byte."""
    client = sdk(gw)
    tools: Any = [{**TOOLS[i % 4], "name": f"tool_{i}"} for i in range(12)]
    history: Any = []
    last_prompt = 0
    m: Any = None  # the last answer: its thinking block goes back with the next tool turn
    for turn in range(21):
        for msg in history:  # the previous turn's mark is dropped, as agents do
            if msg["role"] == "user":
                msg["content"] = [
                    {k: v for k, v in b.items() if k != "cache_control"} for b in msg["content"]
                ]
        if turn:  # the tool call the model made, then its result
            call = {
                "type": "tool_use",
                "id": f"toolu_{turn}",
                "name": "tool_0",
                "input": {"path": f"src/{turn}.py"},
            }
            thoughts = [b.model_dump() for b in m.content if b.type == "thinking"]
            history.append({"role": "assistant", "content": [*thoughts, call]})
            block = {"type": "tool_result", "tool_use_id": call["id"], "content": "out " * 150}
        else:
            block = {"type": "text", "text": "start the task"}
        mark = {"cache_control": {"type": "ephemeral"}}
        history.append({"role": "user", "content": [{**block, **mark}]})
        m = client.messages.create(
            model=SONNET,
            max_tokens=8,
            system=SYSTEM,
            tools=tools,
            messages=history,
            extra_headers={"X-Claude-Code-Session-Id": "agent-on-anthropic"},
            extra_body={
                "thinking": {"type": "adaptive"},
                "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
            },
        )
        u = m.usage
        prompt = u.input_tokens + (u.cache_read_input_tokens or 0)
        prompt += u.cache_creation_input_tokens or 0
        if turn:
            assert (u.cache_read_input_tokens or 0) >= 0.95 * last_prompt, (turn, u)
        last_prompt = prompt
    assert _rebuilt(gw, SONNET) == 21


@pytest.mark.parametrize(
    "target", ["openai/gpt-5", "gemini/gemini-2.5-flash", "deepseek/deepseek-chat"]
)
def test_other_providers_serve_messages_through_their_adapters(gw: Gw, target: str) -> None:
    m = sdk(gw).messages.create(
        model=target,
        max_tokens=16,
        system="You are brief.",
        messages=[{"role": "user", "content": "hello"}],
    )
    assert m.content[0].type == "text" and m.content[0].text
    assert m.usage.output_tokens > 0 and m.usage.input_tokens > 0


def test_alias_falls_back_from_the_local_model(gw: Gw) -> None:
    """The fake local model holds 512 tokens: a coding agent's prompt goes to Anthropic."""
    raw = sdk(gw).messages.with_raw_response.create(
        model="smart",
        max_tokens=16,
        system=SYSTEM,
        messages=[{"role": "user", "content": "hi"}],
    )
    assert raw.headers["x-vcache-target"] == SONNET
    assert raw.headers["x-vcache-fallback-from"] == "local"
    assert raw.parse().content[0].type == "text"
    short = sdk(gw).messages.with_raw_response.create(
        model="smart", max_tokens=16, messages=[{"role": "user", "content": "hi"}]
    )
    assert short.headers["x-vcache-target"] == "local"


@pytest.mark.processes
def test_vcache_replay_rebuilds_a_messages_request(gw: Gw) -> None:
    """A Messages conversation on Anthropic, named by the agent's session header: the CLI
    lists its session and replays its last request to the bytes the emulator received."""
    import subprocess
    import sys

    from manifest.sessionlog import scoped_session

    client = sdk(gw)
    turns: Any = [{"role": "user", "content": "first"}]
    for _ in range(2):
        m = client.messages.create(
            model=SONNET,
            max_tokens=8,
            system=SYSTEM,
            messages=turns,
            extra_headers={"X-Claude-Code-Session-Id": "replayed-agent"},
        )
        answer = [b.model_dump() for b in m.content]
        turns += [{"role": "assistant", "content": answer}, {"role": "user", "content": "next"}]
    log = gw.log()
    rows = log.store.requests(scoped_session("t", "replayed-agent"))
    assert len(rows) == 2
    cli = [sys.executable, "-m", "gateway.cli"]
    db = str(log.store.path)
    listed = subprocess.run([*cli, "sessions", "--db", db], capture_output=True, text=True)
    assert listed.returncode == 0 and rows[0].session_id in listed.stdout, listed.stderr
    done = subprocess.run(
        [*cli, "replay", rows[-1].request_id, "--db", db], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "match: the log rebuilds what was sent" in done.stdout
    assert rows[-1].sha256 == gw.emulator.received()[-1]["sha256"]


def test_thinking_is_relayed_to_anthropic_and_back_untouched(gw: Gw) -> None:
    """Extended thinking through an Anthropic target: the thinking config goes through, the
    answer's thinking block comes back with its signature (whole and streamed), and the
    next turn relays it as written (the emulator checks the signature, and refuses a tool
    turn that lost its thinking block, as Anthropic does); every request rebuilds."""
    client = sdk(gw)
    think: Any = {"type": "enabled", "budget_tokens": 1024}
    ask: Any = [{"role": "user", "content": "read the file, please"}]
    tools: Any = TOOLS[:1]
    m = client.messages.create(
        model=SONNET, max_tokens=2048, thinking=think, tools=tools, messages=ask
    )
    assert gw.emulator.last_body()["thinking"] == think
    assert [b.type for b in m.content][:1] == ["thinking"]
    thought = m.content[0]
    assert thought.type == "thinking" and thought.signature
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and m.stop_reason == "tool_use"
    result = {"type": "tool_result", "tool_use_id": uses[0].id, "content": "file contents"}
    turn: Any = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [result]},
    ]
    with client.messages.stream(
        model=SONNET, max_tokens=2048, thinking=think, tools=tools, messages=turn
    ) as s:
        kinds = [ev.delta.type for ev in s if ev.type == "content_block_delta"]
        final = s.get_final_message()
    sent = gw.emulator.last_body()["messages"][1]["content"]
    assert sent[0] == {
        "type": "thinking",
        "thinking": thought.thinking,
        "signature": thought.signature,
    }
    assert "thinking_delta" in kinds and "signature_delta" in kinds
    assert final.content[0].type == "thinking" and final.content[0].signature
    # the emulator's checks are real: a lost thinking block or a changed signature is a 400
    lost: Any = [turn[0], {"role": "assistant", "content": [uses[0].model_dump()]}, turn[2]]
    with pytest.raises(anthropic.BadRequestError, match="must start with a thinking block"):
        client.messages.create(
            model=SONNET, max_tokens=2048, thinking=think, tools=tools, messages=lost
        )
    forged = copy.deepcopy(turn)
    forged[1]["content"][0]["signature"] = "0" * 64
    with pytest.raises(anthropic.BadRequestError, match="Invalid `signature`"):
        client.messages.create(
            model=SONNET, max_tokens=2048, thinking=think, tools=tools, messages=forged
        )
    assert _rebuilt(gw, SONNET) == 4


def test_rate_limits_and_mid_stream_failures_in_anthropics_shape(gw: Gw) -> None:
    """A provider that keeps answering 429 is the SDK's RateLimitError (with Retry-After);
    a stream cut after it began ends with an ``event: error`` in Anthropic's shape."""
    gw.emulator.admin(
        "faults", kind="status", status=429, retry_after="1", count=10, provider="anthropic"
    )
    with pytest.raises(anthropic.RateLimitError) as limited:
        sdk(gw).messages.create(
            model=SONNET, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert limited.value.response.headers["retry-after"] == "1"
    gw.emulator.admin("reset")
    gw.emulator.admin("faults", kind="cut", after_events=4, provider="anthropic")
    body = {
        "model": SONNET,
        "max_tokens": 64,
        "stream": True,
        "messages": [{"role": "user", "content": "tell me more"}],
    }
    headers = {"x-api-key": KEY}
    with gw.http.stream("POST", "/v1/messages", json=body, headers=headers) as r:
        assert r.status_code == 200  # the stream had begun
        text = "".join(r.iter_text())
    assert text.startswith("event: message_start")
    event, data = text.rstrip().split("\n")[-2:]
    assert event == "event: error"
    err = json.loads(data.removeprefix("data: "))
    assert err["type"] == "error" and err["error"]["type"] == "api_error"
    assert err["request_id"] == r.headers["request-id"]
