"""The provider path against the emulator: hits by each provider's rules, verify-then-account.

Every request goes through the official ``openai`` client to the gateway,
which renders it for the provider and sends it over loopback.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from engines.tokenizer import ChatTokenizer
from tests.providers.conftest import KEY, MODELS, Emulator, Gw, make_gateway

ANCHOR = "".join(
    f"Rule {i}: answer briefly, cite manual section {i}, and never invent a section.\n"
    for i in range(120)
)  # about 9.6 KB: past every provider's minimum (Gemini Flash: 2048 tokens)


def ask(gw: Gw, model: str, question: str, system: str = ANCHOR) -> tuple[Any, dict[str, str]]:
    raw = gw.client().chat.completions.with_raw_response.create(
        model=model,
        messages=[
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        max_tokens=8,
    )
    return raw.parse(), dict(raw.headers)


@pytest.mark.parametrize("provider", list(MODELS))
def test_repeated_anchor_hits_follow_each_providers_rules(gw: Gw, provider: str) -> None:
    model = f"{provider}/{MODELS[provider]}"
    cached, prompt, written = [], [], []
    for q in range(5):
        c, headers = ask(gw, model, f"Question {q}: which section covers rule {q * 7}?")
        assert headers["x-vcache-target"] == model
        assert c.model == model
        assert c.choices[0].message.content
        details = c.usage.prompt_tokens_details
        cached.append(details.cached_tokens)
        prompt.append(c.usage.prompt_tokens)
        written.append(getattr(details, "cache_write_tokens", None) or 0)
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    assert cached[0] == 0
    assert all(n > 0 for n in cached[1:]), cached
    assert all(n <= p for n, p in zip(cached, prompt, strict=True))
    if provider == "anthropic":  # the system breakpoint: the same exact prefix each time
        assert written[0] > 0 and len(set(cached[1:])) == 1
    elif provider == "openai":  # 128-token steps from 1024
        assert all(n >= 1024 and n % 128 == 0 for n in cached[1:])
    elif provider == "deepseek":  # 64-token units
        assert all(n % 64 == 0 for n in cached[1:])
    else:  # Gemini: a cached content once the anchor's reuse reached the break-even (2)
        created = [r for r in gw.emulator.received() if r["path"].endswith("/cachedContents")]
        assert len(created) == 1
        assert len(set(cached[1:])) == 1
    st = gw.stats()[model]
    assert st["requests"] == 5
    assert st["cached_tokens"] == sum(cached)
    assert st["credited_tokens"] == sum(cached)  # every read verified against its record
    assert st["unverified_tokens"] == 0
    assert st["false_warm"] == 0
    rate = sum(cached) / sum(prompt)
    print(f"\n{model}: hit rate {rate:.3f} ({sum(cached)}/{sum(prompt)} prompt tokens)")


@pytest.mark.parametrize("provider", ["anthropic", "openai"])
def test_flushed_cache_is_a_false_warm_and_nothing_is_credited(gw: Gw, provider: str) -> None:
    model = f"{provider}/{MODELS[provider]}"
    ask(gw, model, "first")
    second, _ = ask(gw, model, "second")
    credited = gw.stats()[model]["credited_tokens"]
    assert second.usage.prompt_tokens_details.cached_tokens == credited > 0
    gw.emulator.admin("flush")
    third, _ = ask(gw, model, "third")
    assert third.usage.prompt_tokens_details.cached_tokens == 0
    st = gw.stats()[model]
    assert st["false_warm"] == 1
    assert st["last_false_warm_offset"] is None  # the bytes matched: the provider evicted it
    assert st["credited_tokens"] == credited
    fourth, _ = ask(gw, model, "fourth")  # rewarmed by the third: credited again
    assert fourth.usage.prompt_tokens_details.cached_tokens > 0
    assert gw.stats()[model]["credited_tokens"] > credited


@pytest.fixture
def passthrough(emulator: Emulator, tokenizer: ChatTokenizer) -> Iterator[Gw]:
    emulator.admin("reset")
    yield from make_gateway(emulator, tokenizer, prompt_layout="passthrough")


def _stamped(minute: int) -> str:
    return f"Current time: 2026-11-29T14:{minute:02d}:00Z\n" + ANCHOR


def test_a_timestamp_in_the_system_prompt_is_named_and_breaks_the_anchor(passthrough: Gw) -> None:
    model = f"anthropic/{MODELS['anthropic']}"
    _, headers = ask(passthrough, model, "q1", _stamped(1))
    assert "timestamp@system" in headers["x-vcache-prefix-lint"]
    again, _ = ask(passthrough, model, "q2", _stamped(2))
    assert again.usage.prompt_tokens_details.cached_tokens == 0


def test_the_volatile_layout_moves_the_timestamp_and_the_anchor_hits(gw: Gw) -> None:
    model = f"anthropic/{MODELS['anthropic']}"
    _, headers = ask(gw, model, "q1", _stamped(1))
    assert "timestamp@system" in headers["x-vcache-prefix-lint"]
    again, _ = ask(gw, model, "q2", _stamped(2))
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert gw.stats()[model]["false_warm"] == 0


def test_gemini_cached_content_is_created_used_and_deleted_by_the_break_even(gw: Gw) -> None:
    """Planning decides, the send runs it once the answer is in: the request that meets
    the break-even goes inline and is followed by the creation; the next ones name the
    handle; one after the handle's TTL goes inline and is followed by the deletion."""
    model = f"gemini/{MODELS['gemini']}"
    generate = f"/v1beta/models/{MODELS['gemini']}:generateContent"

    def calls() -> list[str]:
        return [
            r["path"]
            for r in gw.emulator.received()
            if "cachedContents" in r["path"] or r["path"].endswith(":generateContent")
        ]

    ask(gw, model, "one")
    assert calls() == [generate]
    ask(gw, model, "two")  # seen twice within a TTL: k = 2 for r = 0.25, w = 1
    assert calls() == [generate, generate, "/v1beta/cachedContents"]
    third, _ = ask(gw, model, "three")
    assert "cachedContent" in gw.emulator.last_body()  # it names the handle
    fourth, _ = ask(gw, model, "four")
    assert "cachedContent" in gw.emulator.last_body()
    assert calls().count("/v1beta/cachedContents") == 1
    assert (
        third.usage.prompt_tokens_details.cached_tokens
        == fourth.usage.prompt_tokens_details.cached_tokens
        > 0
    )
    gw.clock.now += 3600  # past the handle's TTL on the gateway's clock
    ask(gw, model, "five")
    deletes = [p for p in calls() if p.startswith("/v1beta/cachedContents/")]
    assert len(deletes) == 1 and calls()[-1] == deletes[0]  # after the fifth's answer
    assert gw.stats()["gemini_cached_contents"] == {
        "live": 0,
        "created": 1,
        "deleted": 1,
        "lost": 0,
    }


def test_a_handle_deleted_behind_the_gateways_back_is_resent_inline(gw: Gw) -> None:
    model = f"gemini/{MODELS['gemini']}"
    ask(gw, model, "one")
    ask(gw, model, "two")  # the handle is created after its answer
    gw.emulator.admin("flush")  # drops cached contents too
    third, _ = ask(gw, model, "three")
    assert third.choices[0].message.content
    snap = gw.stats()
    assert snap["gemini_cached_contents"]["lost"] == 1
    assert snap[model]["false_warm"] >= 1


def test_anthropic_warm_prefills_with_max_tokens_zero_then_streams_a_hit(gw: Gw) -> None:
    model = f"anthropic/{MODELS['anthropic']}"
    messages = [
        {"role": "system", "content": ANCHOR},
        {"role": "user", "content": "warm me"},
    ]
    r = gw.http.post(
        "/v1/cache/warm",
        headers={"authorization": f"Bearer {KEY}"},
        json={"model": model, "messages": messages},
    )
    assert r.status_code == 200, r.text
    warm = r.json()
    assert warm["target"] == model and warm["written_tokens"] > 0 and warm["cached_tokens"] == 0
    log = gw.http.app.state.session_log  # type: ignore[attr-defined]
    (row,) = [w for w in log.store.requests() if w.request_id.startswith("warm-")]
    event, data = log.rebuild(row.session_id, row.seq)  # the warm is logged and rebuilds
    assert json.loads(data)["max_tokens"] == 0 and dict(event.directives)["warm"] is True
    assert row.sha256 == gw.emulator.received()[-1]["sha256"]
    stream = gw.client().chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": ANCHOR}, {"role": "user", "content": "real"}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens_details.cached_tokens or 0) > 0  # the warmed system prefix
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert gw.stats()[model]["false_warm"] == 0
