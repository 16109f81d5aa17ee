"""Faults on the provider path: retries, cut streams, error shapes, fallback to the next target."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from engines.tokenizer import ChatTokenizer
from tests.providers.conftest import KEY, MODELS, Emulator, Gw, make_gateway
from tests.settings import gateway_settings

ANTHROPIC = f"anthropic/{MODELS['anthropic']}"
OPENAI = f"openai/{MODELS['openai']}"
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


def test_429_with_retry_after_is_honoured(gw: Gw) -> None:
    gw.emulator.admin("faults", kind="status", status=429, retry_after="1", provider="anthropic")
    c = gw.client().chat.completions.create(model=ANTHROPIC, messages=HELLO, max_tokens=4)
    assert c.choices[0].message.content
    client = gw.path.target(ANTHROPIC).client
    assert client.retries == 1
    assert client.waits[-1] == 1.0  # waited as told, not the 50 ms backoff


def test_retry_after_ms_wins_and_529_is_retried(gw: Gw) -> None:
    gw.emulator.admin(
        "faults",
        kind="status",
        status=529,
        retry_after="30",
        retry_after_ms=300,
        provider="anthropic",
    )
    gw.client().chat.completions.create(model=ANTHROPIC, messages=HELLO, max_tokens=4)
    assert gw.path.target(ANTHROPIC).client.waits[-1] == 0.3  # the milliseconds, not the 30 s


def test_a_dropped_connection_is_retried(gw: Gw) -> None:
    gw.emulator.admin("faults", kind="drop", provider="openai")
    c = gw.client().chat.completions.create(model=OPENAI, messages=HELLO, max_tokens=4)
    assert c.choices[0].message.content
    assert gw.path.target(OPENAI).client.retries == 1


def test_persistent_failure_is_a_clean_502_after_the_retries(gw: Gw) -> None:
    gw.emulator.admin("faults", kind="status", status=500, count=3, provider="openai")
    r = gw.http.post(
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY}"},
        json={"model": OPENAI, "messages": HELLO, "max_tokens": 4},
    )
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["type"] == "upstream_error" and err["code"] == "upstream_unavailable"
    assert "HTTP 500" in err["message"]
    assert gw.path.target(OPENAI).client.retries == 2  # max_retries, then the error


def test_rate_limit_beyond_the_cap_goes_back_to_the_client_with_retry_after(gw: Gw) -> None:
    gw.emulator.admin("faults", kind="status", status=429, retry_after="120", provider="openai")
    r = gw.http.post(
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY}"},
        json={"model": OPENAI, "messages": HELLO, "max_tokens": 4},
    )
    assert r.status_code == 429
    assert r.headers["retry-after"] == "120"
    assert r.json()["error"]["code"] == "upstream_rate_limited"


def test_a_stream_cut_mid_way_gives_the_client_a_clean_error(gw: Gw) -> None:
    gw.emulator.admin("faults", kind="cut", after_events=3, provider="openai")
    stream = gw.client().chat.completions.create(
        model=OPENAI, messages=HELLO, max_tokens=8, stream=True
    )
    got: list[str] = []
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                got.append(chunk.choices[0].delta.content)
    assert got  # text had been streamed before the cut: no retry, no fallback
    assert "stream" in str(info.value.message)
    assert info.value.body is not None
    assert info.value.body["code"] == "upstream_stream_cut"  # type: ignore[index]


@pytest.fixture
def bad_key(emulator: Emulator, tokenizer: ChatTokenizer) -> Iterator[Gw]:
    emulator.admin("reset")
    providers = {"openai": {"base_url": emulator.base_url("openai"), "api_key": "sk-WRONG-1234"}}
    yield from make_gateway(emulator, tokenizer, providers=providers, aliases={})


def test_a_rejected_provider_key_is_a_502_that_never_shows_the_key(bad_key: Gw) -> None:
    r = bad_key.http.post(
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY}"},
        json={"model": OPENAI, "messages": HELLO},
    )
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_auth_failed"
    assert "WRONG" not in r.text


def test_alias_is_served_locally_while_the_engine_is_up(gw: Gw) -> None:
    raw = gw.client().chat.completions.with_raw_response.create(
        model="smart", messages=HELLO, max_tokens=4
    )
    assert raw.headers["x-vcache-target"] == "local"
    assert "x-vcache-fallback-from" not in raw.headers
    assert raw.parse().model == "smart"


def test_engine_stopped_the_request_is_served_by_the_fallback_provider(gw: Gw) -> None:
    gw.http.portal.call(gw.engine.close)  # type: ignore[union-attr]
    raw = gw.client().chat.completions.with_raw_response.create(
        model="smart", messages=HELLO, max_tokens=4
    )
    assert raw.headers["x-vcache-target"] == ANTHROPIC
    assert raw.headers["x-vcache-fallback-from"] == "local"
    assert raw.parse().choices[0].message.content
    stream = gw.client().chat.completions.with_raw_response.create(
        model="smart", messages=HELLO, max_tokens=4, stream=True
    )
    assert stream.headers["x-vcache-target"] == ANTHROPIC
    text = "".join(c.choices[0].delta.content or "" for c in stream.parse() if c.choices)
    assert text
    metrics = gw.http.get("/metrics").text
    assert 'vcache_fallbacks_total{reason="engine_unavailable",target="local"} 2.0' in metrics


def test_a_prompt_too_long_for_the_local_model_falls_back(gw: Gw) -> None:
    # past the fake engine's 512 tokens
    long: list[ChatCompletionMessageParam] = [{"role": "user", "content": "word " * 2000}]
    raw = gw.client().chat.completions.with_raw_response.create(
        model="smart", messages=long, max_tokens=4
    )
    assert raw.headers["x-vcache-target"] == ANTHROPIC


def test_client_mistakes_do_not_fall_back(gw: Gw) -> None:
    r = gw.http.post(
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY}"},
        json={"model": "smart", "messages": HELLO, "temperature": 7},
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "temperature"
    assert len(gw.emulator.received()) == 0


def test_unknown_provider_model_names_are_404(gw: Gw) -> None:
    r = gw.http.post(
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY}"},
        json={"model": "mistral/large", "messages": HELLO},
    )
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"


def test_a_provider_only_gateway_serves_aliases_and_refuses_the_local_model(
    emulator: Emulator,
) -> None:
    from fastapi.testclient import TestClient

    from gateway.app import create_app
    from tests.providers.conftest import provider_settings

    emulator.admin("reset")
    settings = provider_settings(
        emulator, engine={"replicas": 0}, aliases={"fast": [OPENAI, ANTHROPIC]}
    )
    with TestClient(create_app(settings, [], provider_transport=emulator.transport)) as http:
        auth = {"authorization": f"Bearer {KEY}"}
        assert http.get("/readyz").status_code == 200
        assert [m["id"] for m in http.get("/v1/models", headers=auth).json()["data"]] == ["fast"]
        r = http.post(
            "/v1/chat/completions", headers=auth, json={"model": "fast", "messages": HELLO}
        )
        assert r.status_code == 200 and r.headers["x-vcache-target"] == OPENAI
        r = http.post(
            "/v1/chat/completions", headers=auth, json={"model": "vcache-demo", "messages": HELLO}
        )
        assert r.status_code == 404


def test_local_in_an_alias_needs_a_local_replica() -> None:

    with pytest.raises(ValueError, match="needs a local replica"):
        gateway_settings(
            engine={"replicas": 0},
            providers={"openai": {"api_key": "x"}},
            aliases={"a": ["local", OPENAI]},
        )


AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize("provider", ["anthropic", "openai", "gemini", "deepseek"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_that_does_not_parse_is_a_502(gw: Gw, provider: str, stream: bool) -> None:
    gw.emulator.admin("faults", kind="garbage", provider=provider)
    body = {"model": f"{provider}/{MODELS[provider]}", "messages": HELLO, "stream": stream}
    r = gw.http.post("/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    if stream and err["code"] == "upstream_stream_cut":
        # a lenient stream parser skips events it does not know (forward compatible):
        # then the stream ends without an answer
        assert err["message"] == f"{provider}: the stream ended before the answer"
        return
    assert err == {
        "message": f"{provider}: the provider's answer could not be read",
        "type": "upstream_error",
        "param": None,
        "code": "upstream_bad_answer",
    }


@pytest.fixture
def two_providers(emulator: Emulator, tokenizer: ChatTokenizer) -> Iterator[Gw]:
    emulator.admin("reset")
    yield from make_gateway(emulator, tokenizer, aliases={"two": [ANTHROPIC, OPENAI]})


def test_an_alias_falls_back_past_an_answer_that_does_not_parse(two_providers: Gw) -> None:
    gw = two_providers
    gw.emulator.admin("faults", kind="garbage", provider="anthropic")
    body = {"model": "two", "messages": HELLO, "max_tokens": 4}
    r = gw.http.post("/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.headers["x-vcache-target"] == OPENAI
    assert r.headers["x-vcache-fallback-from"] == ANTHROPIC
    metrics = gw.http.get("/metrics").text
    assert (
        f'vcache_fallbacks_total{{reason="upstream_bad_answer",target="{ANTHROPIC}"}} 1.0'
        in metrics
    )
