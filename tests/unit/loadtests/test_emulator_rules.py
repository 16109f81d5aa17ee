"""The provider emulator's caching rules, in process (the wire tests run it on loopback)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from loadtests.emulator.app import create_app
from loadtests.emulator.state import Clock, EmulatorState
from loadtests.emulator.tools import Function, tool_use

A = {"x-api-key": "k", "anthropic-version": "2023-06-01"}
B = {"authorization": "Bearer k"}
G = {"x-goog-api-key": "k"}
LONG = "Policy line that stays the same across requests.\n" * 120  # ~1500 tokens


@pytest.fixture
def emu() -> TestClient:
    return TestClient(create_app(EmulatorState(shards=4, capacity=64)))


def msgs(emu: TestClient, blocks: list[dict[str, Any]], q: str = "q", **kw: Any) -> Any:
    body = {"model": "claude-sonnet-4-5", "max_tokens": 4, "system": blocks}
    body |= {"messages": [{"role": "user", "content": q}], **kw}
    return emu.post("/v1/messages", headers=A, json=body)


def cc(ttl: str = "5m") -> dict[str, str]:
    return {"type": "ephemeral", "ttl": ttl}


def test_anthropic_write_then_read_then_ttl(emu: TestClient) -> None:
    sys_ = [{"type": "text", "text": LONG, "cache_control": cc()}]
    first = msgs(emu, sys_).json()["usage"]
    assert first["cache_read_input_tokens"] == 0
    assert first["cache_creation_input_tokens"] > 1024
    assert (
        first["cache_creation"]["ephemeral_5m_input_tokens"] == first["cache_creation_input_tokens"]
    )
    second = msgs(emu, sys_, "other").json()["usage"]
    assert second["cache_read_input_tokens"] == first["cache_creation_input_tokens"]
    emu.post("/admin/clock/advance", json={"seconds": 299})
    assert msgs(emu, sys_).json()["usage"]["cache_read_input_tokens"] > 0  # a read refreshes
    emu.post("/admin/clock/advance", json={"seconds": 301})
    assert msgs(emu, sys_).json()["usage"]["cache_read_input_tokens"] == 0


def test_anthropic_minimum_prefix_and_one_hour_split(emu: TestClient) -> None:
    short = [{"type": "text", "text": "short", "cache_control": cc()}]
    u = msgs(emu, short).json()["usage"]
    assert u["cache_creation_input_tokens"] == 0  # below 1024 tokens: not cached
    hour = [{"type": "text", "text": LONG, "cache_control": cc("1h")}]
    u = msgs(emu, hour).json()["usage"]
    assert u["cache_creation"]["ephemeral_1h_input_tokens"] == u["cache_creation_input_tokens"] > 0


def test_anthropic_refuses_five_breakpoints_and_misordered_ttls(emu: TestClient) -> None:
    five = [{"type": "text", "text": f"{i}", "cache_control": cc()} for i in range(5)]
    r = msgs(emu, five)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("A maximum of 4 blocks")
    bad = [
        {"type": "text", "text": "a", "cache_control": cc("5m")},
        {"type": "text", "text": "b", "cache_control": cc("1h")},
    ]
    assert msgs(emu, bad).status_code == 400


def test_anthropic_lookback_reaches_twenty_blocks_back(emu: TestClient) -> None:
    base = [{"type": "text", "text": LONG, "cache_control": cc()}]
    msgs(emu, base)
    near = [{"type": "text", "text": LONG}] + [{"type": "text", "text": f"x{i}"} for i in range(18)]
    near[-1]["cache_control"] = cc()  # type: ignore[assignment]
    assert msgs(emu, near).json()["usage"]["cache_read_input_tokens"] > 0
    far = [{"type": "text", "text": LONG}] + [{"type": "text", "text": f"y{i}"} for i in range(25)]
    far[-1]["cache_control"] = cc()  # type: ignore[assignment]
    assert msgs(emu, far).json()["usage"]["cache_read_input_tokens"] == 0


def test_anthropic_warm_with_max_tokens_zero_but_not_streamed(emu: TestClient) -> None:
    sys_ = [{"type": "text", "text": LONG, "cache_control": cc()}]
    warm = msgs(emu, sys_, max_tokens=0).json()
    assert warm["content"] == [] and warm["usage"]["cache_creation_input_tokens"] > 0
    assert msgs(emu, sys_, max_tokens=0, stream=True).status_code == 400


def chat(emu: TestClient, key: str | None, path: str = "/v1/chat/completions") -> Any:
    body: dict[str, Any] = {
        "model": "gpt-5",
        "messages": [{"role": "system", "content": LONG}, {"role": "user", "content": "hi"}],
    }
    if key is not None:
        body["prompt_cache_key"] = key
    return emu.post(path, headers=B, json=body).json()["usage"]


def test_openai_steps_and_cache_key_affinity(emu: TestClient) -> None:
    assert chat(emu, "alpha")["prompt_tokens_details"]["cached_tokens"] == 0
    hit = chat(emu, "alpha")["prompt_tokens_details"]["cached_tokens"]
    assert hit >= 1024 and hit % 128 == 0
    # a different key routes to another shard for at least one of these keys: a cold cache
    misses = [chat(emu, f"k{i}")["prompt_tokens_details"]["cached_tokens"] for i in range(8)]
    assert 0 in misses


def test_deepseek_units_and_fields(emu: TestClient) -> None:
    chat(emu, None, "/deepseek/chat/completions")
    u = chat(emu, None, "/deepseek/chat/completions")
    assert u["prompt_cache_hit_tokens"] % 64 == 0 and u["prompt_cache_hit_tokens"] > 0
    assert u["prompt_cache_hit_tokens"] + u["prompt_cache_miss_tokens"] == u["prompt_tokens"]


def test_lru_capacity_evicts_oldest(emu: TestClient) -> None:
    for i in range(70):  # capacity 64 entries per shard; each prompt writes several
        emu.post(
            "/deepseek/chat/completions",
            headers=B,
            json={"model": "d", "messages": [{"role": "user", "content": f"{i} " + "z" * 400}]},
        )
    first = emu.post(
        "/deepseek/chat/completions",
        headers=B,
        json={"model": "d", "messages": [{"role": "user", "content": "0 " + "z" * 400}]},
    ).json()["usage"]
    assert first["prompt_cache_hit_tokens"] == 0


def test_gemini_cached_content_rules(emu: TestClient) -> None:
    big = {"parts": [{"text": LONG * 2}]}
    small = emu.post(
        "/v1beta/cachedContents",
        headers=G,
        json={"model": "models/gemini-2.5-flash", "systemInstruction": {"parts": [{"text": "x"}]}},
    )
    assert small.status_code == 400 and "too small" in small.json()["error"]["message"]
    made = emu.post(
        "/v1beta/cachedContents",
        headers=G,
        json={"model": "models/gemini-2.5-flash", "systemInstruction": big, "ttl": "600s"},
    ).json()
    contents = [{"role": "user", "parts": [{"text": "hi"}]}]
    url = "/v1beta/models/gemini-2.5-flash:generateContent"
    both = emu.post(
        url,
        headers=G,
        json={"cachedContent": made["name"], "systemInstruction": big, "contents": contents},
    )
    assert both.status_code == 400
    used = emu.post(url, headers=G, json={"cachedContent": made["name"], "contents": contents})
    tokens = made["usageMetadata"]["totalTokenCount"]
    assert used.json()["usageMetadata"]["cachedContentTokenCount"] == tokens
    emu.post("/admin/clock/advance", json={"seconds": 601})
    gone = emu.post(url, headers=G, json={"cachedContent": made["name"], "contents": contents})
    assert gone.status_code == 404 and gone.json()["error"]["status"] == "NOT_FOUND"


def test_auth_and_request_log(emu: TestClient) -> None:
    r = emu.post("/v1/messages", json={"model": "m"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    log = emu.get("/admin/requests").json()
    assert log[-1]["path"] == "/v1/messages" and len(log[-1]["sha256"]) == 64


def test_emulated_tool_use_rule() -> None:
    fns = [
        Function("a", {"properties": {"s": {"type": "string"}, "k": {"enum": ["x", "y"]}}}),
        Function("b", {"properties": {"n": {"type": "integer"}}}),
    ]
    assert tool_use(fns, "none", False, b"r") == []
    assert tool_use(fns, "auto", True, b"r") == []  # the last turn answered a call: text
    assert [u.name for u in tool_use(fns, "auto", False, b"r")] == ["a"]
    assert [u.name for u in tool_use(fns, "any", True, b"r", parallel=True)] == ["a", "b"]
    assert [u.name for u in tool_use(fns, "b", True, b"r", parallel=True)] == ["b"]
    args = tool_use(fns, "auto", False, b"r")[0].args
    assert isinstance(args["s"], str) and args["s"] and args["k"] == "y"
    assert tool_use(fns, "auto", False, b"r") == tool_use(fns, "auto", False, b"r")


def test_rules_the_operator_sets_replace_the_documented_ones(emu: TestClient) -> None:
    emu.post("/admin/rules", json={"provider": "anthropic", "min_prefix": 2000, "ttl_s": 420})
    sys_ = [{"type": "text", "text": LONG, "cache_control": cc()}]  # ~1500 tokens
    assert msgs(emu, sys_).json()["usage"]["cache_creation_input_tokens"] == 0
    longer = [{"type": "text", "text": LONG * 2, "cache_control": cc()}]
    assert msgs(emu, longer).json()["usage"]["cache_creation_input_tokens"] > 2000
    emu.post("/admin/clock/advance", json={"seconds": 400})
    assert msgs(emu, longer).json()["usage"]["cache_read_input_tokens"] > 0  # 5m became 7m
    emu.post("/admin/clock/advance", json={"seconds": 421})
    assert msgs(emu, longer).json()["usage"]["cache_read_input_tokens"] == 0


def test_rate_limits_send_headers_refuse_with_429_and_bill_what_was_served(
    emu: TestClient,
) -> None:
    emu.post("/admin/limits", json={"provider": "anthropic", "rpm": 2, "tpm": 100_000})
    sys_ = [{"type": "text", "text": LONG, "cache_control": cc()}]
    first = msgs(emu, sys_)
    assert first.headers["anthropic-ratelimit-requests-remaining"] == "1"
    assert int(first.headers["anthropic-ratelimit-input-tokens-remaining"]) < 100_000
    assert msgs(emu, sys_).status_code == 200
    third = msgs(emu, sys_)
    assert third.status_code == 429 and third.json()["error"]["type"] == "rate_limit_error"
    assert int(third.headers["retry-after"]) >= 1
    bill = emu.get("/admin/billing").json()["anthropic"]
    assert bill["requests"] == 2 and bill["rejected_429"] == 1
    assert bill["write"] == first.json()["usage"]["cache_creation_input_tokens"]
    assert bill["read"] == bill["write"]  # the second read what the first wrote
    emu.post("/admin/clock/advance", json={"seconds": 61})  # the window slides on
    assert msgs(emu, sys_).status_code == 200
    r = emu.post(
        "/v1/chat/completions",
        headers=B,
        json={"model": "gpt-5", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert "x-ratelimit-remaining-requests" not in r.headers  # no limit set for openai


def test_a_scaled_clock_runs_faster_than_real_time() -> None:
    clock = Clock(scale=100.0)
    t0 = clock.now()
    time.sleep(0.05)
    assert 4.0 < clock.now() - t0 < 50.0


def _streamed(sse: str) -> tuple[list[str], str | None]:
    """The content deltas of an OpenAI stream, and its finish reason."""
    words, finish = [], None
    for line in sse.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                if choice["delta"].get("content"):
                    words.append(choice["delta"]["content"])
                finish = choice.get("finish_reason") or finish
    return words, finish


def test_the_answer_length_is_the_emulators_cut_to_the_request_limit() -> None:
    """``--answer-words``: long streamed answers (many events) for benchmarks; a request's
    own limit still cuts them, reported as such by every provider."""
    emu = TestClient(create_app(EmulatorState(answer_words=200)))
    ask = {"model": "gpt-5", "messages": [{"role": "user", "content": "q"}], "stream": True}
    sse = emu.post("/v1/chat/completions", headers=B, json={**ask, "max_tokens": 500}).text
    words, finish = _streamed(sse)
    assert len(words) == 200 and finish == "stop"
    cut = emu.post("/v1/chat/completions", headers=B, json={**ask, "max_tokens": 50}).text
    words, finish = _streamed(cut)
    assert len(words) == 50 and finish == "length"
    body = {"model": "claude-sonnet-4-5", "max_tokens": 300}
    body["messages"] = [{"role": "user", "content": "q"}]
    text = emu.post("/v1/messages", headers=A, json=body).json()
    assert len(text["content"][0]["text"].split()) == 200 and text["stop_reason"] == "end_turn"
    gem = emu.post(
        "/v1beta/models/gemini-2.5-flash:generateContent",
        headers=G,
        json={"contents": [{"role": "user", "parts": [{"text": "q"}]}]},
    ).json()
    assert len(gem["candidates"][0]["content"]["parts"][0]["text"].split()) == 200
    default = TestClient(create_app(EmulatorState()))
    short = default.post("/v1/chat/completions", headers=B, json={**ask, "stream": False})
    assert len(short.json()["choices"][0]["message"]["content"].split()) == 12
