"""Agent sessions on real vLLM CPU replicas: a turn that ends by calling a tool keeps
the session's KV on its replica until the next turn, through a flood that evicts
everything else there; a turn that answers in text releases it.  The control session,
the same conversation without the tool call, loses its KV to the same flood."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.integration.conftest import KEY_A, Gateway, metric

pytestmark = pytest.mark.integration

BLOCK = 128
REPLICA = "replica-0"
TOOL: Any = {
    "type": "function",
    "function": {
        "name": "run_tests",
        "description": "Run the test suite",
        "parameters": {
            "type": "object",
            "properties": {"suite": {"enum": ["unit", "integration"]}},
            "required": ["suite"],
            "additionalProperties": False,
        },
    },
}
FORCED: Any = {"type": "function", "function": {"name": "run_tests"}}
VOCAB = ["span", "lease", "block", "agent", "tool", "turn", "pause", "replica", "prefix"]


def _system(seed: int) -> str:
    return "You are a coding agent. " + " ".join(random.Random(seed).choices(VOCAB, k=250))


def _turn(c: httpx.Client, model: str, session: str, messages: list[Any], **kw: Any) -> Any:
    r = c.post(
        "/v1/chat/completions",
        json={"model": model, "messages": messages, "max_tokens": 40, "temperature": 0, **kw},
        headers={"x-vcache-session": session, "x-vcache-replica": REPLICA},
    )
    assert r.status_code == 200, r.text
    return r.json()


def _pinned(c: httpx.Client) -> int:
    r = c.get("/v1/cache/stats")
    assert r.status_code == 200, r.text
    return int(r.json()["replicas"][REPLICA]["blocks_pinned"])


def _flood(c: httpx.Client, model: str) -> None:
    """Fill the replica's 128 KV blocks with unrelated prompts (14 blocks each)."""
    for i in range(12):
        ids = [(7000 + i * 53 + j) % 3900 + 100 for j in range(1850)]
        r = c.post("/v1/cache/warm", json={"model": model, "token_ids": ids, "replica": REPLICA})
        assert r.status_code == 200, r.text


def test_a_tool_pause_keeps_the_sessions_kv_through_pressure(gateway: Gateway) -> None:
    model = gateway.model
    headers = {"Authorization": f"Bearer {KEY_A}"}
    with httpx.Client(base_url=gateway.base_url, headers=headers, timeout=300) as c:
        before = _pinned(c)
        ask = [{"role": "user", "content": "Run the unit tests, please."}]
        agent = [{"role": "system", "content": _system(1)}, *ask]
        control = [{"role": "system", "content": _system(2)}, *ask]
        first = _turn(c, model, "agent-keep", agent, tools=[TOOL], tool_choice=FORCED)
        assert first["choices"][0]["finish_reason"] == "tool_calls"
        plain = _turn(c, model, "agent-drop", control, tools=[TOOL], tool_choice="none")
        assert plain["choices"][0]["finish_reason"] != "tool_calls"
        prompt = first["usage"]["prompt_tokens"]
        held = _pinned(c) - before
        assert held == prompt // BLOCK  # the agent's prompt blocks, leased; the control's not
        _flood(c, model)
        call = first["choices"][0]["message"]
        result = {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": "ok"}
        nxt = _turn(c, model, "agent-keep", [*agent, call, result], tools=[TOOL])
        cached = nxt["usage"]["prompt_tokens_details"]["cached_tokens"]
        answer = {"role": "assistant", "content": plain["choices"][0]["message"]["content"]}
        again = _turn(c, model, "agent-drop", [*control, answer, *ask], tools=[TOOL])
        lost = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        print(f"\nafter the flood: leased session {cached} cached tokens, control {lost}")
        assert cached >= (prompt - 1) // BLOCK * BLOCK  # every leased block was read back
        assert lost < BLOCK  # the control's blocks went to the flood
        if nxt["choices"][0]["finish_reason"] != "tool_calls":  # an answer: released
            assert _pinned(c) == before
        final = _turn(
            c, model, "agent-keep", [*agent, call, result], tools=[TOOL], tool_choice="none"
        )
        assert final["choices"][0]["finish_reason"] != "tool_calls"
        assert _pinned(c) == before  # the answer released the session's lease
    metrics = httpx.get(f"{gateway.base_url}/metrics", timeout=10).text
    assert 'vcache_session_retention_total{outcome="leased"}' in metrics
    assert 'vcache_session_retention_total{outcome="released"}' in metrics


def test_concurrent_siblings_meet_one_prefill_and_are_predicted_exactly(
    gateway: Gateway,
) -> None:
    """Requests that share a long prefix, sent at once: the later ones wait for the first
    one's prefill on its replica and are served from it, predicted exactly."""
    system = _system(3) + " " + _system(4)
    headers = {"Authorization": f"Bearer {KEY_A}"}

    start = threading.Barrier(3)  # clients made, connections open: all three post at once

    def one(i: int) -> tuple[int, int | None, str]:
        with httpx.Client(base_url=gateway.base_url, headers=headers, timeout=300) as c:
            assert c.get("/healthz").status_code == 200  # the connection, opened beforehand
            start.wait(timeout=60)
            r = c.post(
                "/v1/chat/completions",
                json={
                    "model": gateway.model,
                    "max_tokens": 2,
                    "messages": [
                        {"role": "system", "content": system},
                        {"role": "user", "content": f"question {i}"},
                    ],
                },
            )
            assert r.status_code == 200, r.text
            predicted = r.headers.get("x-vcache-predicted-cached-tokens")
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            return cached, int(predicted) if predicted else None, r.headers["x-vcache-replica"]

    before = metric(gateway.base_url, 'vcache_prefill_waits_total{outcome="joined"}')
    with ThreadPoolExecutor(3) as pool:  # the gateway under test admits three at once
        got = list(pool.map(one, range(3)))
    print(f"\nsiblings (cached, predicted, replica): {got}")
    assert all(cached == predicted for cached, predicted, _ in got)
    assert len({replica for *_, replica in got}) == 1  # they met on one replica
    served = sorted(cached for cached, *_ in got)
    assert served[0] == 0 and all(c >= 4 * BLOCK for c in served[1:])  # one prefill for all
    assert metric(gateway.base_url, 'vcache_prefill_waits_total{outcome="joined"}') > before


def test_priorities_reach_vllms_priority_scheduler(gateway: Gateway) -> None:
    """The engine runs vLLM's priority scheduling: requests of every priority are served,
    and a bad one is a 400 naming the header."""
    headers = {"Authorization": f"Bearer {KEY_A}"}
    body = {
        "model": gateway.model,
        "max_tokens": 3,
        "messages": [{"role": "user", "content": "priority check"}],
    }
    with httpx.Client(base_url=gateway.base_url, headers=headers, timeout=120) as c:
        for priority in ("batch", "default", "interactive"):
            r = c.post("/v1/chat/completions", json=body, headers={"x-vcache-priority": priority})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 3
        bad = c.post("/v1/chat/completions", json=body, headers={"x-vcache-priority": "vip"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-vcache-priority"
