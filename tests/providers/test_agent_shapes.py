"""What today's agents send, on hosted targets (the emulator): a mid-conversation system
message and its tool changes reach Anthropic as written and OpenAI as a system message
in place (Gemini: a user turn saying what it was); deferred tools stay deferred at
Anthropic; effort and context management reach the provider that takes them; a Codex
request's hosted tools are left out and named on every target, its namespace and custom
tools offered as functions.  Every request rebuilds byte for byte from the log."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import pytest

from engines.tokenizer import ChatTokenizer
from tests.providers.conftest import KEY, MANUAL, MODELS, Emulator, Gw, make_gateway


@pytest.fixture
def gw(emulator: Emulator, tokenizer: ChatTokenizer) -> Iterator[Gw]:
    emulator.admin("reset")
    yield from make_gateway(emulator, tokenizer)


def _tool(name: str, deferred: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": name,
        "description": f"The {name} tool.",
        "input_schema": {"type": "object", "properties": {"arg": {"type": "string"}}},
    }
    return {**out, "defer_loading": True} if deferred else out


def _claude_code(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": 32,
        "system": [{"type": "text", "text": MANUAL, "cache_control": {"type": "ephemeral"}}],
        "tools": [_tool("Bash"), _tool("Edit", True)],
        "messages": [
            {"role": "user", "content": "List the files."},
            {"role": "system", "content": "<system-reminder>none</system-reminder>"},
            {"role": "assistant", "content": "Done."},
            {"role": "user", "content": "Edit one."},
            {
                "role": "system",
                "content": [
                    {"type": "text", "text": "Edit is available."},
                    {
                        "type": "tool_addition",
                        "tool": {"type": "tool_reference", "name": "Edit"},
                        "cache_control": {"type": "ephemeral"},
                    },
                ],
            },
        ],
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
    }


def _post_messages(gw: Gw, body: dict[str, Any]) -> Any:
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    return gw.http.post("/v1/messages", json=body, headers=headers)


def _rebuilt_all(gw: Gw) -> int:
    log = gw.log()
    rows = list(log.store.requests())
    for row in rows:
        _, data = log.rebuild(row.session_id, row.seq)
        assert hashlib.sha256(data).hexdigest() == row.sha256, row.request_id
    return len(rows)


def test_anthropic_gets_system_messages_and_tool_changes_as_written(gw: Gw) -> None:
    r = _post_messages(gw, _claude_code(f"anthropic/{MODELS['anthropic']}"))
    assert r.status_code == 200, r.text
    sent = gw.emulator.last_body()
    roles = [m["role"] for m in sent["messages"]]
    assert roles == ["user", "system", "assistant", "user", "system"]
    assert sent["messages"][1]["content"] == [
        {"type": "text", "text": "<system-reminder>none</system-reminder>"}
    ]
    last = sent["messages"][4]["content"]
    assert last[0] == {"type": "text", "text": "Edit is available."}
    assert last[1]["type"] == "tool_addition"
    assert last[1]["tool"] == {"type": "tool_reference", "name": "Edit"}
    assert "cache_control" in last[1]  # the client's breakpoint, where it put it
    edit = next(t for t in sent["tools"] if t["name"] == "Edit")
    assert edit["defer_loading"] is True
    assert sent["output_config"] == {"effort": "medium"}
    assert sent["context_management"] == {
        "edits": [{"type": "clear_thinking_20251015", "keep": "all"}]
    }
    assert _rebuilt_all(gw) == 1


def test_openai_gets_the_system_message_in_place_with_its_tool_changes_written(gw: Gw) -> None:
    r = _post_messages(gw, _claude_code(f"openai/{MODELS['openai']}"))
    assert r.status_code == 200, r.text
    sent = gw.emulator.last_body()
    roles = [m["role"] for m in sent["messages"]]
    assert roles == ["system", "user", "system", "assistant", "user", "system"]
    last = sent["messages"][5]["content"]
    assert last.startswith("Edit is available.\n\n<tool_added>\n")
    assert '"name": "Edit"' in last
    assert all("defer_loading" not in t for t in sent["tools"])  # no deferral in chat
    assert sent["reasoning_effort"] == "medium"
    assert "context_management" not in sent
    assert _rebuilt_all(gw) == 1


def test_gemini_gets_a_later_system_message_as_a_user_turn_saying_so(gw: Gw) -> None:
    r = _post_messages(gw, _claude_code(f"gemini/{MODELS['gemini']}"))
    assert r.status_code == 200, r.text
    sent = gw.emulator.last_body()
    texts = [p.get("text", "") for c in sent["contents"] for p in c["parts"]]
    assert "[system] <system-reminder>none</system-reminder>" in texts
    assert _rebuilt_all(gw) == 1


def test_codex_hosted_tools_are_left_out_on_a_hosted_target_too(gw: Gw) -> None:
    body = {
        "model": f"openai/{MODELS['openai']}",
        "input": [
            {"type": "message", "role": "developer", "content": MANUAL},
            {"type": "message", "role": "user", "content": "List the files."},
        ],
        "tools": [
            {"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
            {"type": "custom", "name": "apply_patch", "description": "Patch files."},
            {
                "type": "namespace",
                "name": "multi_agent_v1",
                "description": "Agents.",
                "tools": [{"type": "function", "name": "close_agent"}],
            },
            {"type": "web_search", "external_web_access": False},
        ],
        "reasoning": {"effort": "high"},
        "store": False,
        "max_output_tokens": 32,
    }
    r = gw.http.post("/v1/responses", json=body, headers={"authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    assert r.headers["x-vcache-tools-omitted"] == "web_search"
    sent = gw.emulator.last_body()
    names = [t["function"]["name"] for t in sent["tools"]]
    assert names == ["exec_command", "apply_patch", "multi_agent_v1__close_agent"]
    assert sent["reasoning_effort"] == "high"
    assert [m["role"] for m in sent["messages"]] == ["system", "user"]
    assert _rebuilt_all(gw) == 1
