"""Provider adapters, retries and error mapping (no network)."""

from __future__ import annotations

import datetime as dt
import json
import random

import pytest

from engines.providers.anthropic import AnthropicAdapter
from engines.providers.base import CacheDirectives, ChatCall, Turn
from engines.providers.errors import (
    ProviderAuthError,
    ProviderBadRequest,
    ProviderNotFound,
    ProviderOverloaded,
    ProviderRateLimited,
    ProviderTimeout,
    ProviderUnavailable,
    from_status,
)
from engines.providers.gemini import GeminiAdapter
from engines.providers.openai import DeepSeekAdapter, OpenAIAdapter
from engines.providers.retry import RetryPolicy, parse_retry_after
from engines.providers.specs import PROVIDERS
from engines.sse import SSEDecoder
from gateway.core.metrics import Metrics
from gateway.providers.book import PromptView
from gateway.providers.path import ProviderPath
from gateway.providers.targets import target_profile
from manifest.planner import TargetState, plan
from tests.settings import gateway_settings

CALL = ChatCall(
    model="m",
    system="S" * 8000,
    turns=(Turn("user", "q1"), Turn("assistant", "a1"), Turn("user", "q2")),
    max_tokens=5,
)


def test_retry_after_forms() -> None:
    now = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.UTC)
    assert parse_retry_after({"retry-after": "3"}) == 3.0
    assert parse_retry_after({"retry-after-ms": "250", "retry-after": "9"}) == 0.25
    assert parse_retry_after({"retry-after": "Sun, 29 Nov 2026 12:00:07 GMT"}, now) == 7.0
    assert parse_retry_after({"retry-after": "soon"}) is None
    assert parse_retry_after({}) is None


def test_backoff_is_jittered_capped_and_bounded() -> None:
    p = RetryPolicy(max_retries=3, base_s=1.0, cap_s=3.0, max_retry_after_s=10)
    rng = random.Random(7)
    delays = [p.delay(a, None, rng) or -1.0 for a in range(3)]
    assert 0.5 <= delays[0] <= 1.0 and 1.0 <= delays[1] <= 2.0 and 1.5 <= delays[2] <= 3.0
    assert p.delay(3, None, rng) is None  # out of retries
    assert p.delay(0, 4.0, rng) == 4.0  # the server's word
    assert p.delay(0, 60.0, rng) is None  # longer than we wait: the caller decides


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, ProviderBadRequest),
        (401, ProviderAuthError),
        (403, ProviderAuthError),
        (404, ProviderNotFound),
        (408, ProviderTimeout),
        (409, ProviderUnavailable),
        (413, ProviderBadRequest),
        (429, ProviderRateLimited),
        (500, ProviderUnavailable),
        (503, ProviderOverloaded),
        (529, ProviderOverloaded),
    ],
)
def test_statuses_map_to_one_hierarchy(status: int, kind: type) -> None:
    err = from_status("p", status, "m", 2.0)
    assert type(err) is kind
    assert err.retryable == (status in (408, 409, 429, 500, 503, 529))


def _body(r: bytes) -> dict:  # type: ignore[type-arg]
    out: dict = json.loads(r)  # type: ignore[type-arg]
    return out


def test_anthropic_render_places_markers_and_prompt_excludes_them() -> None:
    a = AnthropicAdapter()
    plain = a.render(CALL, CacheDirectives())
    marked = a.render(CALL, CacheDirectives(breakpoints=("system", "message:2"), ttl_s=3600))
    assert plain.prompt == marked.prompt  # markers are not part of the cached prefix
    body = _body(marked.body)
    assert body["system"][0]["cache_control"] == {"type": "ephemeral", "ttl": "1h"}
    assert body["messages"][2]["content"][0]["cache_control"]["ttl"] == "1h"
    assert "cache_control" not in json.dumps(body["messages"][0])
    warm = _body(a.render(CALL, CacheDirectives(warm=True)).body)
    assert warm["max_tokens"] == 0 and "stream" not in warm
    ends = list(marked.segment_ends.values())
    assert ends == sorted(ends) and ends[-1] == len(marked.prompt)


def test_openai_and_deepseek_render() -> None:
    call = ChatCall(model="m", system="sys", turns=(Turn("user", "hi"),), stream=True)
    o = _body(OpenAIAdapter().render(call, CacheDirectives(cache_key="vcache-1")).body)
    assert o["prompt_cache_key"] == "vcache-1"
    assert o["stream_options"] == {"include_usage": True}
    d = _body(DeepSeekAdapter().render(call, CacheDirectives(cache_key="vcache-1")).body)
    assert "prompt_cache_key" not in d


def test_gemini_handle_replaces_system_instruction() -> None:
    call = ChatCall(model="g", system="sys", volatile_system="today", turns=(Turn("user", "hi"),))
    g = GeminiAdapter()
    plain = _body(g.render(call, CacheDirectives()).body)
    assert plain["systemInstruction"]["parts"] == [{"text": "sys"}, {"text": "today"}]
    handled = _body(g.render(call, CacheDirectives(cached_content="cachedContents/x")).body)
    assert "systemInstruction" not in handled and handled["cachedContent"] == "cachedContents/x"
    assert handled["contents"][0] == {"role": "user", "parts": [{"text": "today"}]}


def _events(raw: str) -> list:  # type: ignore[type-arg]
    return SSEDecoder().feed(raw.encode())


def test_stream_parsers_normalize_usage() -> None:
    a = AnthropicAdapter().stream_parser()
    start = {
        "type": "message_start",
        "message": {
            "usage": {
                "input_tokens": 5,
                "cache_creation_input_tokens": 10,
                "cache_read_input_tokens": 100,
            }
        },
    }
    out = []
    for e in _events(
        f"event: message_start\ndata: {json.dumps(start)}\n\n"
        'data: {"type":"content_block_delta","index":0,'
        '"delta":{"type":"text_delta","text":"hi"}}\n\n'
        'data: {"type":"message_delta","delta":{"stop_reason":"max_tokens"},'
        '"usage":{"output_tokens":3}}\n\n'
    ):
        out += a.feed(e)
    assert out[0].text == "hi"
    assert out[1].finish_reason == "length"
    u = out[1].usage
    assert u is not None
    assert (u.prompt_tokens, u.cached_tokens, u.cache_write_tokens, u.completion_tokens) == (
        115,
        100,
        10,
        3,
    )
    ds = DeepSeekAdapter().stream_parser()
    got = []
    for e in _events(
        'data: {"choices":[{"delta":{"content":"x"},"finish_reason":"stop"}]}\n\n'
        'data: {"choices":[],"usage":{"prompt_tokens":100,"completion_tokens":1,'
        '"prompt_cache_hit_tokens":64,"prompt_cache_miss_tokens":36}}\n\ndata: [DONE]\n\n'
    ):
        got += ds.feed(e)
    assert got[-1].usage is not None and got[-1].usage.cached_tokens == 64
    assert got[-1].finish_reason == "stop"
    gm = GeminiAdapter().stream_parser()
    last = []
    for e in _events(
        'data: {"candidates":[{"content":{"parts":[{"text":"a"}]},"finishReason":"STOP"}],'
        '"usageMetadata":{"promptTokenCount":50,"cachedContentTokenCount":40,'
        '"candidatesTokenCount":1}}\r\n\r\n'
    ):
        last += gm.feed(e)
    assert last[-1].usage is not None and last[-1].usage.cached_tokens == 40


@pytest.mark.parametrize("turns", [1, 3, 8, 20])
def test_never_more_than_four_anthropic_breakpoints_and_none_below_the_minimum(
    turns: int,
) -> None:
    settings = gateway_settings(providers={"anthropic": {"api_key": "x"}})
    path = ProviderPath(settings, Metrics())
    t = path.target("anthropic/claude-sonnet-4-5")
    call = ChatCall(
        model=t.model,
        system="policy " * 700,
        turns=tuple(Turn("user" if i % 2 == 0 else "assistant", "x " * 400) for i in range(turns)),
    )
    plain = t.client.adapter.render(call, CacheDirectives())
    view = PromptView.of(t.name, "t", plain.prompt, dict(plain.segment_ends), call.segment_keys())
    for warm in (0, view.tokens[0], view.total_tokens):
        p = plan(view.layout(), t.profile, TargetState(warm, warm_probability=1.0 if warm else 0))
        marked = tuple(view.keys[i] for i in p.breakpoints)
        body = t.client.adapter.render(call, CacheDirectives(breakpoints=marked)).body
        assert 1 <= body.count(b"cache_control") <= 4
        assert all(view.tokens[i] >= t.profile.min_prefix_tokens for i in p.breakpoints)


def test_config_overrides_minimum_and_prices() -> None:
    settings = gateway_settings(
        providers={
            "openai": {
                "api_key": "x",
                "min_prefix_tokens": {"gpt-5": 2048},
                "prices": {"gpt-5": {"read_mult": 0.1, "write_mult": 1.0}},
            }
        }
    )
    prof = target_profile(PROVIDERS["openai"], "gpt-5-mini", settings.providers["openai"])
    assert prof.min_prefix_tokens == 2048 and prof.read_mult == 0.1


def test_aliases_must_name_configured_targets() -> None:
    with pytest.raises(ValueError, match="neither"):
        gateway_settings(aliases={"smart": ["local", "anthropic/claude"]})


def test_tools_render_first_in_each_providers_shape() -> None:
    tool = {
        "type": "function",
        "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
    }
    call = ChatCall(model="m", system="sys", turns=(Turn("user", "hi"),), tools=(tool,))
    assert call.segment_keys()[:2] == ["tools", "system"]
    a = AnthropicAdapter().render(call, CacheDirectives(breakpoints=("tools",)))
    body = _body(a.body)
    assert body["tools"] == [
        {
            "name": "f",
            "description": "d",
            "input_schema": {"type": "object"},
            "cache_control": {"type": "ephemeral", "ttl": "5m"},
        }
    ]
    assert a.segment_ends["tools"] < a.segment_ends["system"]
    o = _body(OpenAIAdapter().render(call, CacheDirectives()).body)
    assert o["tools"] == [tool]
    g = _body(GeminiAdapter().render(call, CacheDirectives()).body)
    assert g["tools"] == [
        {
            "functionDeclarations": [
                {"name": "f", "description": "d", "parameters": {"type": "object"}}
            ]
        }
    ]
