"""A coding agent on the local model (the real vLLM CPU engine) through the Messages API.

The conversation has the shape coding agents send: three system blocks (two marked
``cache_control``), twelve tools with large schemas, thinking and
``context_management``, a rolling breakpoint on the last block of the last user turn,
and twenty tool_use / tool_result turns.  From the second turn on nearly all of the
previous turn's prompt is read from vLLM's prefix cache, the gateway's prediction
equals vLLM's count on every turn, and the blocks through the breakpoint are leased:
under KV pressure from other traffic they survive where an unmarked conversation's
blocks are evicted.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.integration.conftest import own_gateway

pytestmark = pytest.mark.integration

BLOCK = 128
MAX_LEN = 32768
KV_BYTES = 128 << 20  # 512 blocks of 128 tokens (2 KiB a token with the demo model)


@dataclass(frozen=True)
class Local:
    url: str
    closing: contextlib.ExitStack  # the clients handed out, closed with the gateway

    def sdk(self) -> anthropic.Anthropic:
        client = anthropic.Anthropic(base_url=self.url, api_key="unused", max_retries=0)
        return self.closing.enter_context(client)


@pytest.fixture(scope="module")
def local(
    data_dir: Path, demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Local]:
    tmp = tmp_path_factory.mktemp("messages")
    args = ["--kv-cache-bytes", str(KV_BYTES), "--replicas", "1", "--max-model-len", str(MAX_LEN)]
    with own_gateway(tmp, data_dir, args) as url, contextlib.ExitStack() as closing:
        yield Local(url, closing)


def _schema(i: int) -> dict[str, Any]:
    props = {
        f"field_{j}": {"type": "string", "description": f"Field {j} of tool {i}: " + "detail " * 6}
        for j in range(4)
    }
    return {"type": "object", "properties": props, "required": ["field_0"]}


TOOLS: Any = [
    {
        "name": f"tool_{i}",
        "description": f"Tool {i} does one job well. " * 6,
        "input_schema": _schema(i),
    }
    for i in range(12)
]


def _system(nonce: str, marked: bool) -> list[dict[str, Any]]:
    mark = {"cache_control": {"type": "ephemeral"}} if marked else {}
    return [
        {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; {nonce}"},
        {"type": "text", "text": "You are an interactive coding agent. " * 60, **mark},
        {"type": "text", "text": "Follow the repository's conventions. " * 90, **mark},
    ]


class Agent:
    """One agent run: the history it sends, a rolling breakpoint, tool turns."""

    system: Any

    def __init__(self, local: Local, nonce: str, marked: bool = True) -> None:
        self.sdk = local.sdk()
        self.session = f"agent-{nonce}" if marked else None  # in metadata.user_id
        self.system = _system(nonce, marked)
        self.marked = marked
        self.history: Any = []
        self.turn = 0

    def _add_user(self, block: dict[str, Any]) -> None:
        for m in self.history:  # the previous turn's mark moves to this one
            if m["role"] == "user":
                m["content"] = [
                    {k: v for k, v in b.items() if k != "cache_control"} for b in m["content"]
                ]
        if self.marked:
            block = {**block, "cache_control": {"type": "ephemeral"}}
        self.history.append({"role": "user", "content": [block]})

    def step(self) -> tuple[anthropic.types.Message, Any]:
        if self.turn == 0:
            self._add_user({"type": "text", "text": "Fix the failing test in the parser."})
        else:  # the model called a tool (scripted: a random model calls none); its result
            call = {
                "type": "tool_use",
                "id": f"toolu_{self.turn:04d}",
                "name": "tool_3",
                "input": {"field_0": f"src/file_{self.turn}.py"},
            }
            thought = {"type": "thinking", "thinking": "Look at the file.", "signature": "sig"}
            self.history.append({"role": "assistant", "content": [thought, call]})
            result = " ".join(f"line {self.turn}.{i} of the output" for i in range(15))
            self._add_user({"type": "tool_result", "tool_use_id": call["id"], "content": result})
        first = self.turn == 0
        budget: Any = {"type": "enabled", "budget_tokens": 1024} if first else {"type": "adaptive"}
        meta: Any = {"user_id": json.dumps({"session_id": self.session})}
        raw = self.sdk.messages.with_raw_response.create(
            model="vcache-demo",
            max_tokens=1025 if first else 8,
            system=copy.deepcopy(self.system),
            tools=TOOLS,
            messages=copy.deepcopy(self.history),
            thinking=budget,
            metadata=meta,
            extra_body={"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
            extra_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"},
        )
        self.turn += 1
        return raw.parse(), raw.headers


def _prompt(u: Any) -> int:
    return int(
        u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)
    )


def test_coding_agent_reads_each_turn_from_cache_exactly(local: Local) -> None:
    agent = Agent(local, "run-a")
    previous = 0
    for turn in range(21):
        m, headers = agent.step()
        u = m.usage
        read = u.cache_read_input_tokens or 0
        assert int(headers["x-vcache-predicted-cached-tokens"]) == read, (turn, u)
        if turn:
            assert read >= 0.95 * previous, (turn, read, previous)
            assert (u.cache_creation_input_tokens or 0) <= _prompt(u) - read
        previous = _prompt(u)
    assert previous > 14000  # a coding agent's context, grown over 20 tool turns
    counted = agent.sdk.messages.count_tokens(
        model="vcache-demo",
        system=agent.system,
        tools=TOOLS,
        messages=agent.history,
    )
    assert counted.input_tokens == previous


def test_leased_breakpoint_survives_kv_pressure(local: Local) -> None:
    leased, plain = Agent(local, "run-leased"), Agent(local, "run-plain", marked=False)
    for _ in range(3):
        leased.step()
        plain.step()
    # other traffic: more distinct prompt tokens than the KV blocks left unpinned (5 x 11.6k)
    flood = local.sdk()
    for i in range(5):
        words = " ".join(f"unrelated{i} request{j} text" for j in range(900))
        flood.messages.create(
            model="vcache-demo", max_tokens=1, messages=[{"role": "user", "content": words}]
        )
    m_leased, h_leased = leased.step()
    m_plain, h_plain = plain.step()
    kept = m_leased.usage.cache_read_input_tokens or 0
    lost = m_plain.usage.cache_read_input_tokens or 0
    print(
        f"after the flood: leased run read {kept} of {_prompt(m_leased.usage)} prompt tokens, "
        f"the unmarked run {lost} of {_prompt(m_plain.usage)}"
    )
    assert kept >= 0.9 * _prompt(m_leased.usage)
    assert lost < 0.2 * _prompt(m_plain.usage)
    for m, h in ((m_leased, h_leased), (m_plain, h_plain)):
        assert int(h["x-vcache-predicted-cached-tokens"]) == (m.usage.cache_read_input_tokens or 0)


def test_a_stop_sequence_is_named_in_the_stop_reason(local: Local) -> None:
    """vLLM reports which stop string ended the answer: Anthropic's ``stop_sequence``."""
    ask: Any = [{"role": "user", "content": "write a long sentence"}]
    m = local.sdk().messages.create(
        model="vcache-demo",
        max_tokens=300,
        stop_sequences=["a"],
        messages=ask,
        extra_body={"temperature": 0},
    )
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", "a")
    text = m.content[0]
    assert text.type == "text" and "a" not in text.text  # cut before the stop string
    with local.sdk().messages.stream(
        model="vcache-demo",
        max_tokens=300,
        stop_sequences=["a"],
        messages=ask,
        extra_body={"temperature": 0},
    ) as s:
        final = s.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "a")
