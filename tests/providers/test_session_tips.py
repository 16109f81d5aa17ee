"""Agent sessions on hosted providers: the session's own gaps decide how its
conversation is kept across a pause.  Pauses of six minutes on OpenAI (one 5-minute
TTL): the control loop reads the conversation again before it expires, and the next
turn finds it warm; pauses of half an hour on Anthropic: the turn's breakpoints take
the hour tier.  The same pauses without the control loop are misses.  Both clocks
(the gateway's provider clock and the emulator's) move together; ticks run by hand."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engines.tokenizer import ChatTokenizer
from tests.providers.conftest import KEY, MANUAL, MODELS, Emulator, Gw, controlled

ANTHROPIC = f"anthropic/{MODELS['anthropic']}"
OPENAI = f"openai/{MODELS['openai']}"
HEADERS = {"authorization": f"Bearer {KEY}", "x-vcache-session": "agent-run-1"}


@pytest.fixture
def ungoverned(emulator: Emulator, tokenizer: ChatTokenizer) -> Iterator[Gw]:
    yield from controlled(emulator, tokenizer, "off")


class Conversation:
    """An agent's conversation: no system prompt (so no anchor of its own: only the
    session's tip can keep it warm), one long first message, a tool result per turn."""

    def __init__(self, gw: Gw, model: str) -> None:
        self.gw, self.model = gw, model
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": MANUAL}]

    def turn(self, n: int) -> dict[str, Any]:
        body = {"model": self.model, "max_tokens": 4, "messages": self.messages}
        r = self.gw.http.post("/v1/chat/completions", json=body, headers=HEADERS)
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
        self.messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"tool output {n}: " + "result line\n" * 40},
        ]
        usage: dict[str, Any] = r.json()["usage"]
        return usage


def _openai_pauses(gw: Gw, tick: bool) -> dict[str, Any]:
    """Three turns six minutes apart (the third predicts a pause past the TTL), then a
    fourth after another six minutes; the fourth's usage."""
    c = Conversation(gw, OPENAI)
    for n in range(3):
        c.turn(n)
        if n < 2:
            gw.advance(360)
    gw.advance(250)  # past the heartbeat point (0.8 of 300 s)
    if tick:
        gw.tick()
    gw.advance(110)
    return c.turn(3)


def test_a_paused_sessions_conversation_is_heartbeated_and_found_warm(governed: Gw) -> None:
    gw = governed
    before = len(gw.emulator.received())
    usage = _openai_pauses(gw, tick=True)
    tips = gw.control().tips
    assert tips.counts.get("heartbeats") == 1
    assert tips.counts.get("heartbeat", 0) >= 1  # the third turn's plan
    # the heartbeat was the third turn's prompt again (4 turns and 1 heartbeat sent)
    assert len(gw.emulator.received()) == before + 5
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0.7 * usage["prompt_tokens"]


def test_the_same_pauses_without_the_control_loop_are_misses(ungoverned: Gw) -> None:
    usage = _openai_pauses(ungoverned, tick=False)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_half_hour_pauses_take_the_hour_tier_for_the_conversation(governed: Gw) -> None:
    gw = governed
    c = Conversation(gw, ANTHROPIC)
    for n in range(3):
        c.turn(n)
        gw.advance(1800)
    sent = gw.emulator.last_body()  # the third turn: it planned the long tier
    marks = [
        b["cache_control"]
        for m in sent["messages"]
        for b in (m["content"] if isinstance(m["content"], list) else [])
        if isinstance(b, dict) and "cache_control" in b
    ]
    assert marks and all(m.get("ttl") == "1h" for m in marks)
    usage = c.turn(3)  # half an hour later: read, not written again
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0.7 * usage["prompt_tokens"]
    assert gw.control().tips.counts.get("long", 0) >= 1
