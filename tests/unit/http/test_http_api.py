"""The HTTP edge over an in-memory engine: request validation and error bodies.

Every error is asserted as a full OpenAI-shaped body; a client mistake is
never a 500.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engines.fake import FakeEngine, Hold
from engines.tokenizer import ChatTokenizer
from gateway.app import create_app
from gateway.core.config import ApiKeyConfig, hash_api_key
from tests.settings import gateway_settings

MODEL = "vcache-demo"
KEY_A = "sk-tenant-a"


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(str(demo_model))


def _client(fake: FakeEngine, **settings: object) -> TestClient:
    settings.setdefault("grpc_port", None)  # the gRPC edge has its own tests
    app = create_app(gateway_settings(**settings), [fake])
    return TestClient(app)


@pytest.fixture
def engine(tokenizer: ChatTokenizer) -> FakeEngine:
    return FakeEngine(tokenizer, block_size=16, max_model_len=512, max_queued_requests=None)


@pytest.fixture
def client(engine: FakeEngine) -> Iterator[TestClient]:
    with _client(engine, max_request_body_bytes=4096) as c:
        yield c


def chat(**overrides: object) -> dict[str, object]:
    body: dict[str, object] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4,
    }
    body.update(overrides)
    return body


def error(
    message: str, type_: str, param: str | None, code: str | None
) -> dict[str, dict[str, str | None]]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def test_chat_non_streaming(client: TestClient, engine: FakeEngine) -> None:
    r = client.post("/v1/chat/completions", json=chat())
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL
    assert body["choices"][0]["finish_reason"] == "length"
    prompt = len(engine.received[0].prompt_token_ids)
    assert body["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 4,
        "total_tokens": prompt + 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_developer_role_and_text_parts_render_like_system(
    client: TestClient, engine: FakeEngine, tokenizer: ChatTokenizer
) -> None:
    msgs = [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": "hi"},
    ]
    assert client.post("/v1/chat/completions", json=chat(messages=msgs)).status_code == 200
    expected = tokenizer.render_chat(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    assert list(engine.received[0].prompt_token_ids) == expected


def test_chat_streaming_events_and_usage(client: TestClient) -> None:
    body = chat(stream=True, stream_options={"include_usage": True}, max_tokens=3)
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == 3
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert content  # the fake engine's reply, token by token


def test_completions_with_token_ids(client: TestClient, engine: FakeEngine) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2})
    assert r.status_code == 200
    assert r.json()["object"] == "text_completion"
    assert engine.received[0].prompt_token_ids == (5, 6, 7)


def test_cached_tokens_reported_and_salted_by_tenant(client: TestClient) -> None:
    system = {"role": "system", "content": "You are a careful assistant. " * 20}
    first = client.post(
        "/v1/chat/completions", json=chat(messages=[system, {"role": "user", "content": "a"}])
    )
    second = client.post(
        "/v1/chat/completions", json=chat(messages=[system, {"role": "user", "content": "b"}])
    )
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % 16 == 0


def test_models(client: TestClient) -> None:
    r = client.get("/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [MODEL]


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (chat(temperature=3), "temperature", "less than or equal to 2"),
        (chat(top_p=0), "top_p", "greater than 0"),
        (chat(max_tokens=-1), "max_tokens", "greater than or equal to 1"),
        (chat(max_tokens=0), "max_tokens", "greater than or equal to 1"),
        (chat(max_completion_tokens=0), "max_completion_tokens", "greater than or equal to 1"),
        (chat(stop=""), "stop", "at least 1 character"),
        (chat(stop=["ok", ""]), "stop[1]", "at least 1 character"),
        (chat(seed=2**64), "seed", "less than or equal to 9223372036854775807"),
        (chat(seed=-(2**63) - 1), "seed", "greater than or equal to"),
        (
            chat(messages=[{"role": "user", "content": "a\ud800b"}]),
            "messages[0].content",
            "lone surrogate",
        ),
        (
            chat(messages=[{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]),
            "messages[0].content[0].text",
            "lone surrogate",
        ),
        (chat(n=0), "n", "greater than or equal to 1"),
        (chat(n=129), "n", "less than or equal to 128"),
        (chat(top_logprobs=2), "top_logprobs", "needs logprobs: true"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs", "less than or equal to 20"),
        (chat(response_format={"type": "yaml"}), "response_format.type", "Input should be"),
        (
            chat(response_format={"type": "json_schema"}),
            "response_format",
            "needs a json_schema",
        ),
        (
            chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
            "response_format.json_schema.name",
            "Missing required parameter",
        ),
        (chat(messages=[]), "messages", "at least 1"),
        (
            chat(messages=[{"role": "wizard", "content": "x"}]),
            "messages[0].role",
            "Input should be",
        ),
        (chat(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
        (chat(tools=[{"type": "function"}]), "tools[0].function", "Missing required"),
        (
            chat(
                tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice={"type": "function", "function": {"name": "g"}},
            ),
            "tool_choice",
            "names 'g', which is not among the tools",
        ),
        (chat(tool_choice="required"), "tool_choice", "tool_choice needs tools"),
        (chat(model=""), "model", "at least 1"),
        (chat(max_tokens=10_000), "max_tokens", "maximum context length is 512"),
        (chat(max_completion_tokens=10_000), "max_completion_tokens", "maximum context length"),
        (
            chat(messages=[{"role": "user", "content": "word " * 600}]),
            "messages",
            "maximum context",
        ),
    ],
)
def test_invalid_parameters_are_400_naming_the_parameter(
    client: TestClient, body: dict[str, object], param: str, fragment: str
) -> None:
    # json.dumps escapes lone surrogates as \\udXXX, as a client's JSON encoder may
    headers = {"content-type": "application/json"}
    r = client.post("/v1/chat/completions", content=json.dumps(body), headers=headers)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert fragment in err["message"]


def test_missing_field_and_bad_json(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={"model": MODEL})
    assert r.status_code == 400
    assert r.json() == error(
        "Missing required parameter: 'messages'",
        "invalid_request_error",
        "messages",
        "missing_required_parameter",
    )
    r = client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert r.json() == error(
        "The request body is not valid JSON", "invalid_request_error", None, "invalid_json"
    )


def test_unknown_model_is_404(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json=chat(model="gpt-nope"))
    assert r.status_code == 404
    assert r.json() == error(
        "The model 'gpt-nope' does not exist", "not_found_error", "model", "model_not_found"
    )


def test_unknown_path_is_404_in_openai_shape(client: TestClient) -> None:
    r = client.get("/v1/nothing-here")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "unknown_url"


def test_body_over_limit_is_413(client: TestClient) -> None:
    big = chat(messages=[{"role": "user", "content": "x" * 5000}])
    r = client.post("/v1/chat/completions", json=big)
    assert r.status_code == 413
    assert r.json() == error(
        "The request body exceeds the limit of 4096 bytes",
        "invalid_request_error",
        None,
        "request_too_large",
    )


def test_chunked_body_over_limit_is_413(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "vcache-demo", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}]}'

    r = client.post("/v1/chat/completions", content=chunks())
    assert r.status_code == 413


def test_auth_required_when_keys_configured(engine: FakeEngine) -> None:
    keys = [ApiKeyConfig(sha256=hash_api_key(KEY_A), tenant="a")]
    with _client(engine, api_keys=keys) as c:
        r = c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 401
        assert r.json() == error(
            "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'",
            "authentication_error",
            None,
            "missing_api_key",
        )
        r = c.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"})
        assert r.status_code == 401
        assert r.json() == error(
            "Incorrect API key provided", "authentication_error", None, "invalid_api_key"
        )
        ok = c.post(
            "/v1/chat/completions", json=chat(), headers={"Authorization": f"Bearer {KEY_A}"}
        )
        assert ok.status_code == 200
        assert engine.received[-1].cache_salt == "tenant:a"
        assert c.get("/healthz").status_code == 200  # health needs no key


def test_queue_full_is_503_with_retry_after(
    tokenizer: ChatTokenizer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    hold = Hold(at=1)  # the first stream stays under way until the test lets it end
    engine = FakeEngine(tokenizer, hold=hold)
    tokenized = 0
    render, encode = tokenizer.render_chat, tokenizer.encode

    def counted(fn):
        def call(*a, **kw):
            nonlocal tokenized
            tokenized += 1
            return fn(*a, **kw)

        return call

    monkeypatch.setattr(tokenizer, "render_chat", counted(render))
    monkeypatch.setattr(tokenizer, "encode", counted(encode))
    log = {"path": str(tmp_path / "sessions.db")}
    with _client(engine, engine={"max_queued_requests": 1}, session_log=log) as c:
        body = chat(stream=True, max_tokens=50)
        with c.stream("POST", "/v1/chat/completions", json=body) as held:
            assert held.status_code == 200
            before = tokenized
            r = c.post("/v1/chat/completions", json=chat())
            assert r.status_code == 503
            assert r.headers["retry-after"] == "1"
            assert r.json() == error(
                "The gateway's request queue is full; retry shortly",
                "service_unavailable",
                None,
                "queue_full",
            )
            r = c.post("/v1/chat/completions", json=chat(stream=True))
            assert r.status_code == 503
            r = c.post("/v1/chat/completions", json=chat(), headers={"x-vcache-session": "s1"})
            assert r.status_code == 503
            cmpl = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
            for stream in (False, True):
                r = c.post("/v1/completions", json={**cmpl, "stream": stream})
                assert (r.status_code, r.json()["error"]["code"]) == (503, "queue_full")
            # shed before anything else: not tokenized, not in the session log
            assert tokenized == before
            assert len(c.app.state.session_log.store.requests()) == 1  # type: ignore[attr-defined]
            hold.release()
            assert list(held.iter_lines())[-2] == "data: [DONE]"  # the held one finishes
        assert engine.stats().unfinished_requests == 0
        assert c.post("/v1/chat/completions", json=chat()).status_code == 200
        assert len(c.app.state.session_log.store.requests()) == 2  # type: ignore[attr-defined]


def test_engine_overload_maps_to_503(tokenizer: ChatTokenizer) -> None:
    hold = Hold(at=1)  # the first stream stays in the engine until the test lets it end
    engine = FakeEngine(tokenizer, max_queued_requests=1, hold=hold)
    body = chat(stream=True, max_tokens=50)
    with _client(engine) as c, c.stream("POST", "/v1/chat/completions", json=body):
        r = c.post("/v1/chat/completions", json=chat(stream=True))
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "engine_overloaded"
        assert r.headers["retry-after"] == "1"
        hold.release()


def test_not_ready_is_503_and_readyz_says_starting(tokenizer: ChatTokenizer) -> None:
    class SlowStart(FakeEngine):
        async def start(self) -> None:
            import asyncio

            await asyncio.sleep(3600)

    with _client(SlowStart(tokenizer)) as c:
        assert c.get("/healthz").json() == {
            "status": "ok",
            "error": None,
            "replicas": {"replica-0": {"state": "starting", "restarts": 0, "last_error": None}},
            "stores": {},
        }
        assert c.get("/readyz").status_code == 503
        assert c.get("/readyz").json()["status"] == "starting"
        r = c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "engine_starting"


def test_failed_engine_fails_health(tokenizer: ChatTokenizer) -> None:
    class Broken(FakeEngine):
        async def start(self) -> None:
            raise RuntimeError("no GPU memory")

    with _client(Broken(tokenizer)) as c:
        r = c.get("/healthz")
        assert r.status_code == 503
        failed = {"state": "failed", "restarts": 0, "last_error": None}
        assert r.json() == {
            "status": "failed",
            "error": "RuntimeError: no GPU memory",
            "replicas": {"replica-0": failed},
            "stores": {},
        }
        r = c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "engine_failed"


def test_metrics_count_requests_tokens_and_errors(client: TestClient, engine: FakeEngine) -> None:
    client.post("/v1/chat/completions", json=chat())
    client.post("/v1/chat/completions", json=chat(model="nope"))
    whole = engine.received[-1].sampling
    assert whole.stream_interval == whole.max_tokens  # sent whole: outputs coalesced
    text = client.get("/metrics").text
    assert 'vcache_requests_total{route="/v1/chat/completions",status="200"} 1.0' in text
    assert 'vcache_requests_total{route="/v1/chat/completions",status="404"} 1.0' in text
    assert 'vcache_errors_total{type="not_found_error"} 1.0' in text
    local = 'model="vcache-demo",replica="replica-0"'
    assert f"vcache_completion_tokens_total{{{local}}} 4.0" in text
    ttft = 'endpoint="chat",model="vcache-demo",replica="replica-0",target="local"'
    assert f"vcache_ttft_seconds_count{{{ttft}}} 1.0" in text
    assert 'vcache_engine_unfinished_requests{replica="replica-0"} 0.0' in text
    assert 'vcache_engine_kv_cache_usage_ratio{replica="replica-0"}' in text
    # both requests timed; the answer sent whole came in two outputs (the first token,
    # then the other three): no inter-token gap is observed for it
    assert 'vcache_request_duration_seconds_count{route="/v1/chat/completions"} 2.0' in text
    itl = 'model="vcache-demo",replica="replica-0",target="local"'
    assert f"vcache_inter_token_latency_seconds_count{{{itl}}} 0.0" in text
    with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
        assert r.status_code == 200 and sum(1 for _ in r.iter_lines()) > 4
    assert engine.received[-1].sampling.stream_interval is None
    # 4 tokens streamed one step apart make 3 inter-token gaps
    text = client.get("/metrics").text
    assert f"vcache_inter_token_latency_seconds_count{{{itl}}} 3.0" in text


def test_the_event_loop_is_watched_from_startup(client: TestClient) -> None:
    """The app's watch thread times its loop (one sample every 0.1 s)."""

    def samples() -> float:
        for line in client.get("/metrics").text.splitlines():
            if line.startswith("vcache_event_loop_lag_seconds_count "):
                return float(line.split()[-1])
        return 0.0

    deadline = time.monotonic() + 5
    while samples() < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert samples() >= 2


def test_cache_api_validation_and_access(engine: FakeEngine) -> None:
    keys = [
        ApiKeyConfig(sha256=hash_api_key(KEY_A), tenant="a", admin=True),
        ApiKeyConfig(sha256=hash_api_key("sk-user"), tenant="u"),
    ]
    with _client(engine, api_keys=keys) as c:
        admin = {"Authorization": f"Bearer {KEY_A}"}
        r = c.get("/v1/cache/stats", headers={"Authorization": "Bearer sk-user"})
        assert r.status_code == 403
        assert r.json()["error"]["code"] == "admin_required"
        body = {"model": MODEL, "prompt": "x", "token_ids": [1, 2]}
        r = c.post("/v1/cache/lookup", json=body, headers=admin)
        assert r.status_code == 400
        assert "exactly one of" in r.json()["error"]["message"]
        r = c.post(
            "/v1/cache/pin", json={"model": MODEL, "prompt": "x", "lease_s": -1}, headers=admin
        )
        assert (r.status_code, r.json()["error"]["param"]) == (400, "lease_s")
        # the fake engine publishes no KV events: exact tracking is unavailable, said so
        r = c.post("/v1/cache/lookup", json={"model": MODEL, "prompt": "x"}, headers=admin)
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "kv_tracking_unavailable"
        assert r.headers["retry-after"] == "5"


def test_routing_override_needs_admin_and_a_known_policy(engine: FakeEngine) -> None:
    keys = [
        ApiKeyConfig(sha256=hash_api_key(KEY_A), tenant="a", admin=True),
        ApiKeyConfig(sha256=hash_api_key("sk-user"), tenant="u"),
    ]
    with _client(engine, api_keys=keys) as c:
        user = {"Authorization": "Bearer sk-user", "x-vcache-routing": "round_robin"}
        assert c.post("/v1/chat/completions", json=chat(), headers=user).status_code == 403
        bad = {"Authorization": f"Bearer {KEY_A}", "x-vcache-routing": "random"}
        r = c.post("/v1/chat/completions", json=chat(), headers=bad)
        assert (r.status_code, r.json()["error"]["param"]) == (400, "x-vcache-routing")
        ok = {"Authorization": f"Bearer {KEY_A}", "x-vcache-routing": "least_loaded"}
        r = c.post("/v1/chat/completions", json=chat(), headers=ok)
        assert r.status_code == 200
        assert r.headers["x-vcache-replica"] == "replica-0"
        assert "x-vcache-predicted-cached-tokens" not in r.headers  # no exact tracking here


def test_replica_override_header(engine: FakeEngine) -> None:
    keys = [ApiKeyConfig(sha256=hash_api_key(KEY_A), tenant="a", admin=True)]
    with _client(engine, api_keys=keys) as c:
        auth = {"Authorization": f"Bearer {KEY_A}"}
        r = c.post(
            "/v1/chat/completions", json=chat(), headers={**auth, "x-vcache-replica": "replica-0"}
        )
        assert (r.status_code, r.headers["x-vcache-replica"]) == (200, "replica-0")
        r = c.post(
            "/v1/chat/completions", json=chat(), headers={**auth, "x-vcache-replica": "nope"}
        )
        assert r.status_code == 404
        assert r.json()["error"] == {
            "message": "Unknown replica 'nope'",
            "type": "not_found_error",
            "param": "x-vcache-replica",
            "code": "replica_not_found",
        }


def test_admin_scope_is_its_tenant_unless_global(engine: FakeEngine) -> None:
    keys = [
        ApiKeyConfig(sha256=hash_api_key(KEY_A), tenant="a", admin=True),
        ApiKeyConfig(sha256=hash_api_key("sk-root"), tenant="ops", admin=True, scope="global"),
    ]
    hashes = {"model": MODEL, "block_hashes": ["00" * 32]}
    with _client(engine, api_keys=keys) as c:
        tenant_admin = {"Authorization": f"Bearer {KEY_A}"}
        for path in ("/v1/cache/lookup", "/v1/cache/pin", "/v1/cache/unpin", "/v1/cache/evict"):
            r = c.post(path, json=hashes, headers=tenant_admin)
            assert r.status_code == 403, path
            assert r.json()["error"]["code"] == "global_admin_required"
            other = {"model": MODEL, "prompt": "x", "tenant": "b"}
            r = c.post(path, json=other, headers=tenant_admin)
            assert r.status_code == 403
            assert r.json()["error"]["message"] == "Only a global admin key may name another tenant"
        # a global admin passes the scope check (then: no exact tracking on the fake engine)
        r = c.post("/v1/cache/evict", json=hashes, headers={"Authorization": "Bearer sk-root"})
        assert r.json()["error"]["code"] == "kv_tracking_unavailable"


@pytest.mark.parametrize(
    ("prompt", "param", "fragment"),
    [
        ([1, -1], "prompt[1]", "greater than or equal to 0"),
        ([1, 10**9], "prompt[1]", "out of vocabulary"),
        ([[3, 10**9]], "prompt[0][1]", "out of vocabulary"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_400(
    client: TestClient, prompt: object, param: str, fragment: str
) -> None:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, "invalid_value")
    assert fragment in err["message"]


def test_session_names_are_scoped_per_tenant(engine: FakeEngine, tmp_path: Path) -> None:
    keys = [
        ApiKeyConfig(sha256=hash_api_key(KEY_A), tenant="a"),
        ApiKeyConfig(sha256=hash_api_key("sk-b"), tenant="b"),
    ]
    log = {"path": str(tmp_path / "sessions.db")}
    with _client(engine, api_keys=keys, session_log=log) as c:
        # b takes the name first: a is not refused (no squatting), each has its own session
        for key in ("sk-b", KEY_A, KEY_A):
            h = {"Authorization": f"Bearer {key}", "x-vcache-session": "shared-name"}
            r = c.post("/v1/chat/completions", json=chat(), headers=h)
            assert r.status_code == 200, r.text
            assert r.headers["x-vcache-session"] == "shared-name"
        store = c.app.state.session_log.store  # type: ignore[attr-defined]
        assert store.tenant("a/shared-name") == "a" and store.tenant("b/shared-name") == "b"
        assert len(store.requests("a/shared-name")) == 2
        assert len(store.requests("b/shared-name")) == 1
        # an implicit session's name, sent back by another tenant, is not that session
        h = {"Authorization": f"Bearer {KEY_A}"}
        first = c.post("/v1/chat/completions", json=chat(), headers=h)
        name = first.headers["x-vcache-session"]
        assert not name.startswith("a/")
        hb = {"Authorization": "Bearer sk-b", "x-vcache-session": name}
        assert c.post("/v1/chat/completions", json=chat(), headers=hb).status_code == 200
        assert len(store.requests(f"a/{name}")) == 1
        assert len(store.requests(f"b/{name}")) == 1


def test_session_states_are_bounded_and_retention_forgets_them(
    engine: FakeEngine, tmp_path: Path
) -> None:
    """At most ``cached_sessions`` folded states stay in memory; a session that fell out, or
    was deleted by retention, still logs requests that rebuild byte for byte (the app
    verifies every dispatch against the store: a stale state would be a 500)."""
    from manifest.sessionlog import HeaderEvent, Reason

    log_cfg = {"path": str(tmp_path / "s.db"), "cached_sessions": 2, "retention_days": None}
    with _client(engine, session_log=log_cfg) as c:
        log = c.app.state.session_log  # type: ignore[attr-defined]
        msgs: dict[int, list[dict[str, str]]] = {i: [] for i in range(5)}
        for turn in range(2):
            for i in range(5):
                msgs[i].append({"role": "user", "content": f"session {i} turn {turn}"})
                h = {"x-vcache-session": f"s{i}"}
                r = c.post("/v1/chat/completions", json=chat(messages=msgs[i]), headers=h)
                assert r.status_code == 200, r.text
                msgs[i].append(
                    {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}
                )
                assert len(log._states) <= 2
        reasons = [
            e.reason for _, e in log.store.events("default/s0") if isinstance(e, HeaderEvent)
        ]
        assert reasons == [Reason.INITIAL, Reason.RESUME]  # it fell out between its turns
        assert c.portal.call(log.retain, 0.0, None) == 5  # type: ignore[union-attr]
        assert len(log._states) == 0
        r = c.post("/v1/chat/completions", json=chat(), headers={"x-vcache-session": "s0"})
        assert r.status_code == 200, r.text
        first = log.store.events("default/s0")[0][1]
        assert isinstance(first, HeaderEvent) and first.reason == Reason.INITIAL


def test_openapi_describes_errors_auth_and_bodies(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    chat_op = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat_op["security"] == [{"bearer": []}]
    assert "422" not in chat_op["responses"]
    ok = chat_op["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("/ChatCompletion")
    assert "text/event-stream" in ok
    err = chat_op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
    assert err.endswith("/ErrorResponse")
    assert {"401", "404", "503"} <= set(chat_op["responses"])
    assert "security" not in doc["paths"]["/healthz"]["get"]  # probes need no key


def test_version_is_served_and_printed(
    client: TestClient, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway.cli import main

    body = client.get("/version").json()
    assert body["version"] and body["python"].count(".") == 2
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith(f"vcache {body['version']} (vllm ")


def test_the_vocabulary_bound_is_the_larger_of_tokenizer_and_model(
    tokenizer: ChatTokenizer,
) -> None:
    """As vLLM's own check: a model with more embedding rows than tokens accepts those ids."""
    padded = tokenizer.vocab_size + 64
    with _client(FakeEngine(tokenizer, vocab_size=padded)) as c:
        body = {"model": MODEL, "max_tokens": 1}
        ok = c.post("/v1/completions", json={**body, "prompt": [1, padded - 1]})
        assert ok.status_code == 200, ok.text
        bad = c.post("/v1/completions", json={**body, "prompt": [1, padded]})
        assert bad.status_code == 400
        assert bad.json()["error"]["message"].endswith(f"0 to {padded - 1})")
