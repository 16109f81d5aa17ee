"""What Claude Code sends on the Messages API, over an in-memory engine: its first request
of a task carries a mid-conversation system message, later ones add deferred tools with
``tool_addition`` blocks where they sit; both render on the local model in place, so the
prompt before them stays token-identical and cached.  Anthropic's placement rules are a
400 naming the message.  A chat template that takes system messages only up front gets
them as a marked user turn, the same for every request.  The shapes are Claude Code
2.1.328's (recorded from the CLI, shorter texts); the real CLI runs in tests/agents."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.core.config import ApiKeyConfig, hash_api_key
from gateway.sessions.render import chat_prompt, inline_system
from tests.settings import gateway_settings

MODEL = "vcache-demo"
KEY = "sk-claude-code"
SESSION = "10667613-ac51-4d01-90a7-473eb6ecb93d"
BETAS = (
    "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
    "per-turn-control-2026-07-01,mid-conversation-tool-changes-2026-07-01,"
    "thinking-token-count-2026-05-13,advanced-tool-use-2025-11-20,effort-2025-11-24"
)


def _tool(name: str, deferred: bool = False) -> dict[str, Any]:
    tool: dict[str, Any] = {
        "name": name,
        "description": f"The {name} tool. " * 10,
        "input_schema": {"type": "object", "properties": {"arg": {"type": "string"}}},
    }
    if deferred:
        tool["defer_loading"] = True
    return tool


SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328;"},
    {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
    {
        "type": "text",
        "text": "You help with software tasks. " * 60,
        "cache_control": {"type": "ephemeral"},
    },
]
REMINDER = "<system-reminder>Skills available: none.</system-reminder> " * 20
TASK = [
    {"type": "text", "text": "<system-reminder>CLAUDE.md: be brief</system-reminder>"},
    {"type": "text", "text": "List the files."},
]


def first_request(**over: Any) -> dict[str, Any]:
    body = {
        "model": "claude-opus-5-5",
        "max_tokens": 64,
        "stream": True,
        "system": SYSTEM,
        "tools": [
            _tool("Bash"),
            _tool("DeferredToolPlaceholder", True),
            _tool("Read"),
            _tool("Edit", True),
            _tool("Write", True),
        ],
        "messages": [
            {"role": "user", "content": TASK},
            {
                "role": "system",
                "content": [
                    {"type": "text", "text": REMINDER, "cache_control": {"type": "ephemeral"}}
                ],
            },
        ],
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": SESSION})},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
    }
    return {**body, **over}


def later_request() -> dict[str, Any]:
    """The task's third request: the first system message now a string (as the CLI sends
    it again), an answer, a user turn, and a system message adding two deferred tools."""
    body = first_request()
    body["tools"] = [
        _tool("Bash"),
        _tool("Edit", True),
        _tool("Write", True),
        _tool("DeferredToolPlaceholder", True),
        _tool("Read"),
    ]
    body["messages"] = [
        {"role": "user", "content": TASK},
        {"role": "system", "content": REMINDER},
        {"role": "assistant", "content": [{"type": "text", "text": "Here are the files."}]},
        {"role": "user", "content": "Now edit one."},
        {
            "role": "system",
            "content": [
                {"type": "text", "text": "Deferred tools are now available."},
                {"type": "tool_addition", "tool": {"type": "tool_reference", "name": "Edit"}},
                {
                    "type": "tool_addition",
                    "tool": {"type": "tool_reference", "name": "Write"},
                    "cache_control": {"type": "ephemeral"},
                },
            ],
        },
    ]
    return body


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(str(demo_model))


@pytest.fixture
def gw(tokenizer: ChatTokenizer, tmp_path: Path) -> Iterator[tuple[FakeEngine, TestClient]]:
    engine = FakeEngine(tokenizer, block_size=16, max_model_len=8192, reply=" done.")
    log = {"path": str(tmp_path / "s.db"), "verify_reconstruction": True}
    keys = [ApiKeyConfig(sha256=hash_api_key(KEY), tenant="t", name="cc")]
    aliases = {"claude-opus-5-5": ["local"]}
    cfg = gateway_settings(grpc_port=None, session_log=log, api_keys=keys, aliases=aliases)
    with TestClient(create_app(cfg, [engine])) as http:
        yield engine, http


def _post(http: TestClient, body: dict[str, Any]) -> Any:
    headers = {
        "x-api-key": KEY,
        "anthropic-beta": BETAS,
        "anthropic-version": "2023-06-01",
        "x-claude-code-session-id": SESSION,
    }
    return http.post("/v1/messages", json=body, headers=headers)


def test_the_first_request_of_a_task_is_served_with_its_system_message_in_place(
    gw: tuple[FakeEngine, TestClient], tokenizer: ChatTokenizer
) -> None:
    engine, http = gw
    r = _post(http, first_request())
    assert r.status_code == 200, r.text
    assert r.headers["x-vcache-session"] == SESSION
    prompt = tokenizer.decode(list(engine.received[-1].prompt_token_ids), skip_special_tokens=False)
    # the system message sits after the task, as a system turn of the template
    assert prompt.index("List the files.") < prompt.index("Skills available")
    assert "<|im_start|>system\n<system-reminder>Skills available" in prompt
    # deferred tools are not offered up front
    assert '"name": "Bash"' in prompt and '"name": "Read"' in prompt
    assert '"name": "Edit"' not in prompt and "DeferredToolPlaceholder" not in prompt


def test_tool_additions_render_where_they_sit_and_the_prompt_before_them_is_kept(
    gw: tuple[FakeEngine, TestClient], tokenizer: ChatTokenizer
) -> None:
    engine, http = gw
    assert _post(http, first_request(stream=False)).status_code == 200
    first = list(engine.received[-1].prompt_token_ids)
    r = _post(http, {**later_request(), "stream": False})
    assert r.status_code == 200, r.text
    later = list(engine.received[-1].prompt_token_ids)
    head = len(first) - 3  # up to the first request's generation prompt
    # reordered deferred tools, a list become a string: the same tokens up front
    assert later[:head] == first[:head]
    assert r.json()["usage"]["cache_read_input_tokens"] >= head // 16 * 16 - 16
    text = tokenizer.decode(later, skip_special_tokens=False)
    tail = text[text.index("Now edit one.") :]
    assert "Deferred tools are now available." in tail
    added = tail.index("<tool_added>\n")
    assert added < tail.index('"name": "Edit"') < tail.index('"name": "Write"')
    assert tail.count("<tool_added>") == 2
    assert "defer_loading" not in text


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "system", "content": "first"}, {"role": "user", "content": "hi"}], "messages.0"),
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "a"},
                {"role": "system", "content": "after an answer"},
            ],
            "messages.2",
        ),
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "system", "content": "s"},
                {"role": "user", "content": "again"},
            ],
            "messages.1",
        ),
        (
            [
                {"role": "user", "content": "hi"},
                {"role": "system", "content": "s"},
                {"role": "system", "content": "t"},
            ],
            "messages.1",
        ),
        (
            [
                {"role": "user", "content": "hi"},
                {
                    "role": "system",
                    "content": [
                        {
                            "type": "tool_addition",
                            "tool": {"type": "tool_reference", "name": "Nope"},
                        }
                    ],
                },
            ],
            "messages.1.content.0.tool.name",
        ),
        (
            [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_addition",
                            "tool": {"type": "tool_reference", "name": "Bash"},
                        }
                    ],
                }
            ],
            "messages.0",
        ),
        (
            [
                {"role": "user", "content": "hi"},
                {
                    "role": "system",
                    "content": [{"type": "tool_use", "id": "t", "name": "Bash", "input": {}}],
                },
            ],
            "messages.1.content.0.type",
        ),
    ],
)
def test_anthropics_placement_rules_are_a_400_naming_the_message(
    gw: tuple[FakeEngine, TestClient], messages: list[dict[str, Any]], param: str
) -> None:
    _, http = gw
    r = _post(http, first_request(messages=messages, stream=False))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert param in err["message"], err


# a template that raises on a system message after the first, as Qwen3's does
LEADING_ONLY = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_takes_system_messages_only_up_front_gets_them_inline(
    tokenizer: ChatTokenizer,
) -> None:
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": "Be brief."},
    ]
    template = {"chat_template": LEADING_ONLY}
    ids = chat_prompt(tokenizer, messages, None, template)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>user\n<system>\nBe brief.\n</system><|im_end|>" in text
    assert text.startswith("<|im_start|>system\nYou are helpful.")
    # a later request of the same conversation extends it
    longer = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "x"}]
    again = chat_prompt(tokenizer, longer, None, template)
    assert again[: len(ids) - 3] == ids[: len(ids) - 3]
    assert inline_system(messages[:2]) == messages[:2]  # nothing to move: unchanged


def test_an_operators_output_ceiling_cuts_an_agents_max_tokens_and_says_so(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    """Claude Code asks for 128,000 output tokens, Codex for none: ``engine.max_output_tokens``
    serves each at most that many, and the answer says it stopped at the limit."""
    engine = FakeEngine(tokenizer, block_size=16, max_model_len=8192, reply=" more" * 50)
    keys = [ApiKeyConfig(sha256=hash_api_key(KEY), tenant="t", name="cc")]
    cfg = gateway_settings(
        grpc_port=None,
        api_keys=keys,
        aliases={"claude-opus-5-5": ["local"]},
        engine={"max_output_tokens": 8},
    )
    with TestClient(create_app(cfg, [engine])) as http:
        r = _post(http, first_request(stream=False, max_tokens=128000))
        assert r.status_code == 200, r.text
        assert r.headers["x-vcache-max-tokens-clamped"] == "8"
        body = r.json()
        assert body["usage"]["output_tokens"] == 8 and body["stop_reason"] == "max_tokens"
        h = {"authorization": f"Bearer {KEY}"}
        c = http.post("/v1/responses", json={"model": MODEL, "input": "hi"}, headers=h)
        assert c.status_code == 200, c.text
        assert c.headers["x-vcache-max-tokens-clamped"] == "8"
        assert c.json()["usage"]["output_tokens"] == 8 and c.json()["status"] == "incomplete"


def test_clear_tool_uses_is_applied_on_the_local_model_as_anthropic_defines_it(
    gw: tuple[FakeEngine, TestClient], tokenizer: ChatTokenizer
) -> None:
    """Past the trigger, all but the last ``keep`` tool results become a placeholder; the
    edited conversation is what the model sees and what the log rebuilds (verify on)."""
    engine, http = gw
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Look around."}]
    for i in range(4):
        messages.append(
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": f"t{i}", "name": "Bash", "input": {"command": "ls"}}
                ],
            }
        )
        messages.append(
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": f"t{i}", "content": f"file-{i}.txt"}
                ],
            }
        )
    edit = {
        "type": "clear_tool_uses_20250919",
        "trigger": {"type": "input_tokens", "value": 50},
        "keep": {"type": "tool_uses", "value": 1},
    }
    body = first_request(stream=False, messages=messages, context_management={"edits": [edit]})
    r = _post(http, body)
    assert r.status_code == 200, r.text
    assert r.headers["x-vcache-context-edits"] == "clear_tool_uses_20250919:3"
    prompt = tokenizer.decode(list(engine.received[-1].prompt_token_ids))
    assert prompt.count("This tool result was cleared") == 3
    assert "file-3.txt" in prompt and "file-0.txt" not in prompt
    below = {**edit, "trigger": {"type": "input_tokens", "value": 100_000}}
    r = _post(http, {**body, "context_management": {"edits": [below]}})
    assert r.status_code == 200 and "x-vcache-context-edits" not in r.headers
    assert "file-0.txt" in tokenizer.decode(list(engine.received[-1].prompt_token_ids))


def test_an_answer_the_ceiling_cut_may_end_as_the_models_own_end(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    """``engine.max_output_tokens_finish: stop``: Claude Code and Codex take a cut answer
    as a failed turn, so one the operator's ceiling cut ends as ``end_turn`` /
    ``completed``; the header still says it was clamped.  A client's own limit still
    ends as ``max_tokens``."""
    engine = FakeEngine(tokenizer, block_size=16, max_model_len=8192, reply=" more" * 50)
    keys = [ApiKeyConfig(sha256=hash_api_key(KEY), tenant="t", name="cc")]
    engine_cfg = {"max_output_tokens": 8, "max_output_tokens_finish": "stop"}
    cfg = gateway_settings(
        grpc_port=None, api_keys=keys, aliases={"claude-opus-5-5": ["local"]}, engine=engine_cfg
    )
    with TestClient(create_app(cfg, [engine])) as http:
        r = _post(http, first_request(stream=False, max_tokens=128000))
        assert r.status_code == 200 and r.headers["x-vcache-max-tokens-clamped"] == "8"
        assert r.json()["stop_reason"] == "end_turn" and r.json()["usage"]["output_tokens"] == 8
        own = _post(http, first_request(stream=False, max_tokens=4))
        assert own.json()["stop_reason"] == "max_tokens"
        h = {"authorization": f"Bearer {KEY}"}
        c = http.post(
            "/v1/responses", json={"model": MODEL, "input": "hi", "stream": True}, headers=h
        )
        events = [json.loads(x[6:]) for x in c.text.splitlines() if x.startswith("data: ")]
        assert events[-1]["type"] == "response.completed"
        assert events[-1]["response"]["status"] == "completed"
