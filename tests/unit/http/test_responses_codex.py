"""What the Codex CLI sends on the Responses API, over an in-memory engine, driven by the
official ``openai`` client: custom (freeform) and namespace tools rendered as functions
and their calls mapped back, hosted tools left out and named, reasoning items sent back
without changing the prompt, ``prompt_cache_key`` as the session, ``max_tool_calls``, and
each new field echoed or refused by name.  The shapes are Codex 0.169.0's (its first
request and the turn after a tool call, as recorded from the CLI; the namespace tool is
the issue's ``multi_agent_v1``).  The real CLI runs in tests/agents."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.core.config import ApiKeyConfig, hash_api_key
from manifest.sessionlog import HeaderEvent
from tests.settings import gateway_settings

MODEL = "vcache-demo"
KEY = "sk-codex"
THREAD = "01a245ee-3239-7313-afcc-3dc2e06dbd11"
GRAMMAR = 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\n'
EXEC: dict[str, Any] = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command in a PTY.",
    "strict": False,
    "parameters": {
        "type": "object",
        "properties": {"cmd": {"type": "string"}},
        "required": ["cmd"],
        "additionalProperties": False,
    },
}
PATCH: dict[str, Any] = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Use the `apply_patch` tool to edit files.",
    "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR},
}
AGENTS: dict[str, Any] = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Sub-agents you can start and steer.",
    "tools": [
        {
            "type": "function",
            "name": "close_agent",
            "description": "Close an agent.",
            "strict": False,
            "parameters": {
                "type": "object",
                "properties": {"id": {"type": "string"}},
                "required": ["id"],
            },
        },
        {
            "type": "function",
            "name": "send_input",
            "description": "Send input.",
            "strict": False,
            "parameters": {"type": "object", "properties": {}},
        },
    ],
}
HOSTED: list[dict[str, Any]] = [
    {"type": "tool_search", "execution": "client"},
    {"type": "web_search", "external_web_access": False, "search_content_types": ["text"]},
]
DEVELOPER = "<permissions instructions>You run in a sandbox.</permissions instructions> " * 30


def first_request(**over: Any) -> dict[str, Any]:
    """Codex's first request of a task (its fields and shapes; shorter texts)."""
    body: dict[str, Any] = {
        "model": MODEL,
        "instructions": "You are Codex, a coding agent. " * 20,
        "input": [
            {
                "type": "message",
                "role": "developer",
                "id": "msg_1",
                "content": [{"type": "input_text", "text": DEVELOPER}],
            },
            {
                "type": "message",
                "role": "developer",
                "id": "msg_2",
                "content": [
                    {"type": "input_text", "text": "<apps_instructions/>"},
                    {"type": "input_text", "text": "<skills_instructions/>"},
                ],
            },
            {
                "type": "message",
                "role": "user",
                "id": "msg_3",
                "content": [{"type": "input_text", "text": "<environment_context/>"}],
            },
            {
                "type": "message",
                "role": "user",
                "id": "msg_4",
                "content": [{"type": "input_text", "text": "List the files here."}],
            },
        ],
        "tools": [EXEC, PATCH, AGENTS, *HOSTED],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": THREAD,
        "text": {"verbosity": "low"},
        "client_metadata": {"session_id": THREAD, "x-codex-window-id": f"{THREAD}:0"},
        "max_output_tokens": 64,
    }
    return {**body, **over}


HEADERS = {
    "session-id": THREAD,
    "thread-id": THREAD,
    "x-codex-window-id": f"{THREAD}:0",
    "x-client-request-id": THREAD,
    "originator": "codex_exec",
    "x-codex-turn-metadata": json.dumps({"turn_id": "t1", "request_kind": "turn"}),
}


def call_text(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(str(demo_model))


class Gw:
    def __init__(self, engine: FakeEngine, http: TestClient, db: Path) -> None:
        self.engine, self.http, self.db = engine, http, db

    def post(self, body: dict[str, Any], **headers: str) -> Any:
        h = {"authorization": f"Bearer {KEY}", **HEADERS, **headers}
        return self.http.post("/v1/responses", json=body, headers=h)

    def events(self, body: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
        r = self.post({**body, "stream": True})
        out = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        return r, out

    def prompt(self, i: int = -1) -> list[int]:
        return list(self.engine.received[i].prompt_token_ids)

    def configs(self) -> list[dict[str, Any]]:
        """The call configs of the session log's header snapshots, in order."""
        store = self.http.app.state.service.log.store  # type: ignore[attr-defined]
        with sqlite3.connect(self.db) as db:
            sessions = [row[0] for row in db.execute("SELECT id FROM sessions ORDER BY created")]
        return [
            e.header.settings()
            for sid in sessions
            for _, e in store.events(sid)
            if isinstance(e, HeaderEvent)
        ]


def _gw(tokenizer: ChatTokenizer, tmp_path: Path, reply: str) -> Iterator[Gw]:
    engine = FakeEngine(tokenizer, block_size=16, max_model_len=8192, reply=reply)
    db = tmp_path / "s.db"
    log = {"path": str(db), "verify_reconstruction": True}
    keys = [ApiKeyConfig(sha256=hash_api_key(KEY), tenant="t", name="codex")]
    cfg = gateway_settings(grpc_port=None, session_log=log, api_keys=keys)
    with TestClient(create_app(cfg, [engine])) as http:
        yield Gw(engine, http, db)


@pytest.fixture
def text_gw(tokenizer: ChatTokenizer, tmp_path: Path) -> Iterator[Gw]:
    yield from _gw(tokenizer, tmp_path, " done.")


def test_codex_first_request_is_served_with_hosted_tools_left_out_and_named(
    text_gw: Gw, tokenizer: ChatTokenizer
) -> None:
    r, events = text_gw.events(first_request())
    assert r.status_code == 200, r.text
    assert r.headers["x-vcache-tools-omitted"] == "tool_search, web_search"
    assert r.headers["x-vcache-session"] == THREAD
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    done = events[-1]["response"]
    # echoed as sent: the tools (hosted ones too), reasoning, verbosity, the cache key
    assert [t["type"] for t in done["tools"]] == [
        "function",
        "custom",
        "namespace",
        "tool_search",
        "web_search",
    ]
    assert done["reasoning"]["effort"] == "medium" and done["store"] is False
    assert done["text"]["verbosity"] == "low" and done["prompt_cache_key"] == THREAD
    prompt = tokenizer.decode(text_gw.prompt())
    # what the model sees: the function, the custom tool as a one-argument function with
    # its grammar, the namespace's tools under their qualified names; no hosted tool
    assert '"name": "exec_command"' in prompt and '"name": "apply_patch"' in prompt
    assert "multi_agent_v1__close_agent" in prompt and "multi_agent_v1__send_input" in prompt
    assert "lark grammar" in prompt and "begin_patch" in prompt
    assert "web_search" not in prompt and "tool_search" not in prompt
    # both developer messages reached the model, in order
    assert prompt.index("<permissions instructions>") < prompt.index("<apps_instructions/>")
    # the header snapshot records what was left out and the effort asked for
    config = text_gw.configs()[-1]
    assert list(config["omitted_tools"]) == ["tool_search", "web_search"]
    assert config["effort"] == "medium"


def test_a_tool_choice_that_needs_a_hosted_tool_is_refused_by_name(text_gw: Gw) -> None:
    r = text_gw.post(first_request(stream=False, tool_choice={"type": "web_search"}))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "tool_choice.type" and "web_search" in err["message"]
    only_hosted = first_request(stream=False, tools=HOSTED, tool_choice="required")
    r = text_gw.post(only_hosted)
    assert r.status_code == 400 and "web_search" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("over", "param"),
    [
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"include": ["reasoning.secret"]}, "include"),
        (
            {"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}},
            "tool_choice.type",
        ),
        ({"tool_choice": {"type": "function", "name": "close_agent"}}, "tool_choice.name"),
        ({"tools": [{"type": "namespace", "name": "ns", "tools": []}]}, "tools"),
        ({"tools": [EXEC, EXEC]}, "tools"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning"),
        ({"service_tier": "fastest"}, "service_tier"),
        # found by the contract fuzzer: a hosted type is named in a header (was a 500)
        ({"tools": [{"type": "w\u00c3b"}]}, "tools"),
    ],
)
def test_what_codex_could_send_wrong_is_refused_by_name(
    text_gw: Gw, over: dict[str, Any], param: str
) -> None:
    r = text_gw.post(first_request(stream=False, **over))
    assert r.status_code == 400, r.text
    assert str(r.json()["error"]["param"]).startswith(param), r.json()


def test_a_namespace_tools_call_comes_back_with_its_namespace(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    reply = call_text("multi_agent_v1__close_agent", {"id": "a1"})
    for gw in _gw(tokenizer, tmp_path, reply):
        n = len(tokenizer.encode(reply))
        whole = gw.post(first_request(stream=False, max_output_tokens=n)).json()
        calls = [o for o in whole["output"] if o["type"] == "function_call"]
        assert calls and calls[0]["name"] == "close_agent"
        assert calls[0]["namespace"] == "multi_agent_v1"
        assert json.loads(calls[0]["arguments"]) == {"id": "a1"}
        _, events = gw.events(first_request(max_output_tokens=n))
        added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
        assert added[0]["type"] == "function_call" and added[0]["namespace"] == "multi_agent_v1"


def test_a_custom_tools_call_comes_back_as_its_input_text(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n"
    reply = call_text("apply_patch", {"input": patch})
    for gw in _gw(tokenizer, tmp_path, reply):
        n = len(tokenizer.encode(reply))
        whole = gw.post(first_request(stream=False, max_output_tokens=n)).json()
        calls = [o for o in whole["output"] if o["type"] == "custom_tool_call"]
        assert calls and calls[0]["name"] == "apply_patch" and calls[0]["input"] == patch
        assert calls[0]["call_id"]
        _, events = gw.events(first_request(max_output_tokens=n))
        kinds = [e["type"] for e in events]
        assert "response.function_call_arguments.delta" not in kinds
        done = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
        assert done and done[0]["input"] == patch
        item = next(e["item"] for e in events if e["type"] == "response.output_item.done")
        assert item["type"] == "custom_tool_call" and item["input"] == patch


def test_max_tool_calls_keeps_the_first_calls(tokenizer: ChatTokenizer, tmp_path: Path) -> None:
    reply = (
        call_text("exec_command", {"cmd": "ls"}) + "\n" + call_text("exec_command", {"cmd": "pwd"})
    )
    for gw in _gw(tokenizer, tmp_path, reply):
        n = len(tokenizer.encode(reply))
        body = first_request(stream=False, max_output_tokens=n, max_tool_calls=1)
        whole = gw.post(body).json()
        calls = [o for o in whole["output"] if o["type"] == "function_call"]
        assert len(calls) == 1 and whole["max_tool_calls"] == 1
        _, events = gw.events({**body, "stream": True})
        added = [e for e in events if e["type"] == "response.output_item.added"]
        assert len([e for e in added if e["item"]["type"] == "function_call"]) == 1


def test_the_turn_after_a_tool_call_extends_the_prompt_whatever_reasoning_comes_back(
    tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    """Codex sends the whole history back with ``store: false``: the reasoning item (with
    its encrypted content), the call, its output, and the custom tool's round trip.  The
    reasoning is not shown to the model, so the new prompt extends the first one token
    for token and reads it from the cache."""
    for gw in _gw(tokenizer, tmp_path, " ok"):
        first = first_request(stream=False)
        r1 = gw.post(first)
        assert r1.status_code == 200, r1.text
        before = gw.prompt()
        history = [
            *first["input"],
            {
                "type": "reasoning",
                "id": "rs_1",
                "encrypted_content": "b3BhcXVl",
                "summary": [{"type": "summary_text", "text": "**Listing files**"}],
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "exec_command",
                "arguments": '{"cmd": "ls"}',
                "status": "completed",
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "README.md\n"},
            {
                "type": "function_call",
                "call_id": "call_2",
                "name": "close_agent",
                "namespace": "multi_agent_v1",
                "arguments": '{"id": "a1"}',
            },
            {"type": "function_call_output", "call_id": "call_2", "output": "closed"},
            {
                "type": "custom_tool_call",
                "call_id": "call_3",
                "name": "apply_patch",
                "input": "*** Begin Patch\n*** End Patch\n",
            },
            {"type": "custom_tool_call_output", "call_id": "call_3", "output": "Done!"},
        ]
        r2 = gw.post(first_request(stream=False, input=history))
        assert r2.status_code == 200, r2.text
        after = gw.prompt()
        shared = len(before) - 8  # the first prompt up to its generation prompt
        assert after[:shared] == before[:shared]
        text = tokenizer.decode(after)
        assert "b3BhcXVl" not in text and "Listing files" not in text
        assert "multi_agent_v1__close_agent" in text and "README.md" in text
        assert '"input": "*** Begin Patch' in text and "Done!" in text
        usage = r2.json()["usage"]
        assert usage["input_tokens_details"]["cached_tokens"] >= shared // 16 * 16 - 16
        # the same reasoning sent again changes nothing: byte-identical prompt
        gw.post(first_request(stream=False, input=history))
        assert gw.prompt() == after


def test_prompt_cache_key_names_the_session_where_no_header_does(text_gw: Gw) -> None:
    h = {"authorization": f"Bearer {KEY}"}
    r = text_gw.http.post("/v1/responses", json=first_request(stream=False), headers=h)
    assert r.status_code == 200 and r.headers["x-vcache-session"] == THREAD
