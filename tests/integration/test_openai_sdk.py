"""The gateway over a real vLLM CPU engine, driven by the official openai SDK."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from engines.tokenizer import ChatTokenizer
from tests.integration.conftest import BODY_LIMIT, KEY_A, KEY_B, MAX_QUEUED, Gateway, wait_for

pytestmark = pytest.mark.integration

BLOCK = 128  # vLLM's CPU block size
SYSTEM = (
    "You are the support assistant of a company that builds inference gateways. "
    "Answer questions about caching, routing and latency precisely and briefly. "
) * 12


@pytest.fixture(scope="module")
def tokenizer(demo_model: Path) -> ChatTokenizer:
    return ChatTokenizer.from_pretrained(str(demo_model))


def _tally(gateway: Gateway) -> tuple[int, int]:
    """(predictions matched, missed) over every replica, from the cache stats."""
    stats = httpx.get(
        f"{gateway.base_url}/v1/cache/stats", headers={"Authorization": f"Bearer {KEY_A}"}
    ).json()
    matched = sum(r["predictions"]["matched"] for r in stats["replicas"].values())
    missed = sum(r["predictions"]["missed"] for r in stats["replicas"].values())
    return matched, missed


@pytest.fixture(scope="module", autouse=True)
def tally_before(gateway: Gateway) -> tuple[int, int]:
    """The tally before this module's first request (the gateway is the session's: other
    modules' requests came before)."""
    return _tally(gateway)


def test_models(gateway: Gateway) -> None:
    models = gateway.client().models.list()
    assert [m.id for m in models.data] == [gateway.model]
    card = models.data[0].model_dump()
    # vLLM's fields, which its benchmark client reads (root: where the tokenizer is)
    assert Path(card["root"]).is_dir() and card["parent"] is None


def test_chat_non_streaming(gateway: Gateway, tokenizer: ChatTokenizer) -> None:
    messages = [{"role": "user", "content": "What is a prefix cache?"}]
    r = gateway.client().chat.completions.create(
        model=gateway.model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "chat.completion"
    assert r.model == gateway.model
    assert r.choices[0].finish_reason == "length"
    assert isinstance(r.choices[0].message.content, str)
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(tokenizer.render_chat(messages))
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_chat_streaming(gateway: Gateway) -> None:
    stream = gateway.client().chat.completions.create(
        model=gateway.model,
        messages=[{"role": "user", "content": "Stream me some tokens"}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text


def test_completions_text_and_token_ids(gateway: Gateway, tokenizer: ChatTokenizer) -> None:
    client = gateway.client()
    r = client.completions.create(model=gateway.model, prompt="Once upon a time", max_tokens=5)
    assert r.object == "text_completion"
    assert r.usage is not None and r.usage.prompt_tokens == len(
        tokenizer.encode("Once upon a time")
    )
    ids = tokenizer.encode("the cache model token")
    r = client.completions.create(
        model=gateway.model, prompt=ids, max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert r.usage is not None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 3)
    stream = client.completions.create(
        model=gateway.model, prompt=ids, max_tokens=4, stream=True, extra_body={"ignore_eos": True}
    )
    parts = list(stream)
    assert parts[-1].choices[0].finish_reason == "length"


def _expected_cached(first: list[int], second: list[int]) -> int:
    """What vLLM's prefix cache can serve: whole shared blocks, never the last prompt token."""
    common = 0
    for a, b in zip(first, second, strict=False):
        if a != b:
            break
        common += 1
    return min(common, len(second) - 1) // BLOCK * BLOCK


def test_shared_system_prompt_is_served_from_cache(
    gateway: Gateway, tokenizer: ChatTokenizer
) -> None:
    client = gateway.client(KEY_A)
    m1 = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "How do I warm a cache?"},
    ]
    m2 = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What evicts a block?"},
    ]
    r1 = client.chat.completions.create(model=gateway.model, messages=m1, max_tokens=2)  # type: ignore[arg-type]
    r2 = client.chat.completions.create(model=gateway.model, messages=m2, max_tokens=2)  # type: ignore[arg-type]
    assert r1.usage is not None and r2.usage is not None
    assert r1.usage.prompt_tokens_details is not None and r2.usage.prompt_tokens_details is not None
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    expected = _expected_cached(tokenizer.render_chat(m1), tokenizer.render_chat(m2))
    assert expected >= 3 * BLOCK  # the shared system prompt spans several blocks
    cached = r2.usage.prompt_tokens_details.cached_tokens
    print(f"\nrepeated-prefix: prompt_tokens={r2.usage.prompt_tokens} cached_tokens={cached}")
    assert cached == expected

    # Another tenant never shares those spans: the cache salt carries the tenant.
    r3 = gateway.client(KEY_B).chat.completions.create(
        model=gateway.model,
        messages=m2,  # type: ignore[arg-type]
        max_tokens=2,
    )
    assert r3.usage is not None and r3.usage.prompt_tokens_details is not None
    assert r3.usage.prompt_tokens_details.cached_tokens == 0


def test_metrics_fold_tokens(gateway: Gateway) -> None:
    before = gateway.metrics()
    r = gateway.client().chat.completions.create(
        model=gateway.model,
        messages=[{"role": "user", "content": "count me"}],
        max_tokens=3,
        extra_body={"ignore_eos": True},
    )
    after = gateway.metrics()
    assert r.usage is not None
    assert (
        after["vcache_prompt_tokens_total"] - before.get("vcache_prompt_tokens_total", 0)
        == r.usage.prompt_tokens
    )
    assert (
        after["vcache_completion_tokens_total"] - before.get("vcache_completion_tokens_total", 0)
        == 3
    )
    key = 'vcache_requests_total{route="/v1/chat/completions",status="200"}'
    assert after[key] - before.get(key, 0) == 1
    # the engine core's own queue time (queued → scheduled), once per request, per replica
    queued = [k for k in after if k.startswith("vcache_queue_time_seconds_count{")]
    assert queued and all('replica="' in k and f'model="{gateway.model}"' in k for k in queued)
    counts = sum(after[k] - before.get(k, 0) for k in queued)
    assert counts == 1
    waited = sum(after[k] for k in after if k.startswith("vcache_queue_time_seconds_sum{"))
    assert 0 <= waited < 60
    # its TTFT by phase: the engine core's stamps and the gateway's, on one clock
    ttft = _grew(before, after, "vcache_ttft_seconds_sum{")
    phases = {
        p: _grew(before, after, f'vcache_ttft_phase_seconds_sum{{phase="{p}"')
        for p in ("prepare", "gate", "submit", "queue", "prefill", "return")
    }
    counted = _grew(before, after, 'vcache_ttft_phase_seconds_count{phase="prefill"')
    assert counted == 1
    assert all(s >= 0 for s in phases.values())
    assert phases["prefill"] > 0  # the core computed the prompt
    assert sum(phases.values()) == pytest.approx(ttft, abs=0.005)


def _grew(before: dict[str, float], after: dict[str, float], prefix: str) -> float:
    return sum(v - before.get(k, 0) for k, v in after.items() if k.startswith(prefix))


# ------------------------------------------------------------------ errors


def test_invalid_parameter_is_400(gateway: Gateway) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        gateway.client().chat.completions.create(
            model=gateway.model, messages=[{"role": "user", "content": "x"}], temperature=5
        )
    assert err.value.status_code == 400
    assert err.value.body == {
        "message": "Invalid value for 'temperature': Input should be less than or equal to 2",
        "type": "invalid_request_error",
        "param": "temperature",
        "code": "invalid_value",
    }


def test_context_overflow_is_400(gateway: Gateway) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        gateway.client().completions.create(model=gateway.model, prompt=[7] * 2100, max_tokens=1)
    assert err.value.body == {
        "message": "This model's maximum context length is 2048 tokens; the prompt has 2100 tokens",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "context_length_exceeded",
    }


def test_out_of_vocabulary_token_is_400(gateway: Gateway) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        gateway.client().completions.create(
            model=gateway.model, prompt=[1, 2, 999999], max_tokens=1
        )
    assert isinstance(err.value.body, dict)
    assert err.value.body["type"] == "invalid_request_error"
    assert "999999" in err.value.body["message"]


def test_missing_and_wrong_key_are_401(gateway: Gateway) -> None:
    r = httpx.get(f"{gateway.base_url}/v1/models")
    assert r.status_code == 401
    assert r.json() == {
        "error": {
            "message": "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'",
            "type": "authentication_error",
            "param": None,
            "code": "missing_api_key",
        }
    }
    with pytest.raises(openai.AuthenticationError) as err:
        gateway.client("sk-not-a-key").models.list()
    assert err.value.body == {
        "message": "Incorrect API key provided",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }


def test_unknown_model_is_404(gateway: Gateway) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        gateway.client().chat.completions.create(
            model="gpt-5", messages=[{"role": "user", "content": "x"}]
        )
    assert err.value.body == {
        "message": "The model 'gpt-5' does not exist",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_body_over_limit_is_413(gateway: Gateway) -> None:
    body = {"model": gateway.model, "messages": [{"role": "user", "content": "z" * BODY_LIMIT}]}
    r = httpx.post(
        f"{gateway.base_url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY_A}"},
    )
    assert r.status_code == 413
    assert r.json() == {
        "error": {
            "message": f"The request body exceeds the limit of {BODY_LIMIT} bytes",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_too_large",
        }
    }


class _HeldStream:
    """A streamed response read up to its first content, kept open until closed.

    The line iterator must stay referenced: closing it (or letting it be
    collected) closes the connection, which is itself a disconnect.
    """

    def __init__(self, resp: httpx.Response) -> None:
        self.resp = resp
        self.lines = resp.iter_lines()
        for line in self.lines:
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                break

    def close(self) -> None:
        self.resp.close()


def _open_stream(client: httpx.Client, gateway: Gateway) -> _HeldStream:
    req = client.build_request(
        "POST",
        f"{gateway.base_url}/v1/chat/completions",
        json={
            "model": gateway.model,
            "messages": [{"role": "user", "content": "Keep talking for a long while."}],
            "max_tokens": 1900,
            "ignore_eos": True,
            "stream": True,
        },
        headers={"Authorization": f"Bearer {KEY_A}"},
    )
    resp = client.send(req, stream=True)
    assert resp.status_code == 200
    return _HeldStream(resp)


def _engine_idle(gateway: Gateway) -> bool:
    m = gateway.metrics()
    return (
        m["vcache_engine_unfinished_requests"] == 0
        and m["vcache_engine_core_running_requests"] == 0
        and m["vcache_engine_core_waiting_requests"] == 0
    )


def test_disconnect_mid_stream_aborts_engine_request(gateway: Gateway) -> None:
    before = gateway.metrics()
    with httpx.Client(timeout=60) as client:
        held = _open_stream(client, gateway)
        assert gateway.metrics()["vcache_engine_core_running_requests"] == 1
        held.close()  # the client goes away mid-stream
    wait_for(lambda: _engine_idle(gateway), timeout_s=30)
    after = gateway.metrics()
    aborted = 'vcache_requests_aborted_total{endpoint="chat"}'
    assert after[aborted] - before.get(aborted, 0) == 1
    generated = after["vcache_completion_tokens_total"] - before.get(
        "vcache_completion_tokens_total", 0
    )
    assert 0 < generated < 1900  # stopped early, not run to max_tokens
    stats = httpx.get(
        f"{gateway.base_url}/v1/cache/stats",
        headers={"Authorization": f"Bearer {KEY_A}"},
        timeout=30,
    ).json()
    for replica, st in stats["replicas"].items():
        e = st["engine"]  # one reading of the core: its blocks in use are the pins alone
        in_use = e["num_blocks"] - 1 - e["free_blocks"]  # the null block is never free
        assert in_use == e["pinned_blocks"], (replica, e)  # none held for the request


def test_full_queue_is_503_with_retry_after(gateway: Gateway) -> None:
    clients = [httpx.Client(timeout=60) for _ in range(MAX_QUEUED)]
    try:
        held = [_open_stream(c, gateway) for c in clients]
        with pytest.raises(openai.InternalServerError) as err:
            gateway.client().chat.completions.create(
                model=gateway.model,
                messages=[{"role": "user", "content": "one more"}],
                max_tokens=1,
            )
        assert err.value.status_code == 503
        assert err.value.response.headers["retry-after"] == "1"
        assert err.value.body == {
            "message": "The gateway's request queue is full; retry shortly",
            "type": "service_unavailable",
            "param": None,
            "code": "queue_full",
        }
        for resp in held:
            resp.close()
    finally:
        for c in clients:
            c.close()
    wait_for(lambda: _engine_idle(gateway), timeout_s=30)
    ok = gateway.client().chat.completions.create(
        model=gateway.model, messages=[{"role": "user", "content": "after"}], max_tokens=1
    )
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_health_endpoints(gateway: Gateway) -> None:
    ready = {"state": "ready", "restarts": 0, "last_error": None}
    replicas = {"replica-0": ready, "replica-1": ready}
    healthz = httpx.get(f"{gateway.base_url}/healthz").json()
    assert healthz == {"status": "ok", "error": None, "replicas": replicas, "stores": {}}
    assert httpx.get(f"{gateway.base_url}/health").json() == healthz
    readyz = httpx.get(f"{gateway.base_url}/readyz").json()
    stores = {"session_log": "ok"}  # readiness checks the log's store
    assert readyz == {"status": "ready", "error": None, "replicas": replicas, "stores": stores}
    version = httpx.get(f"{gateway.base_url}/version").json()
    assert version["vllm"].startswith("0.32")
    body = httpx.get(f"{gateway.base_url}/metrics").text
    assert "vcache_ttft_seconds_bucket" in body


def test_prediction_tally_over_the_session(gateway: Gateway, tally_before: tuple[int, int]) -> None:
    """Every request so far was predicted before dispatch; report how many came true, and
    that this module's own requests (14 chats and completions) were predicted exactly."""
    matched, missed = _tally(gateway)
    m = gateway.metrics()
    assert m['vcache_cached_token_predictions_total{outcome="matched"}'] == matched
    assert m.get('vcache_cached_token_predictions_total{outcome="missed"}', 0) == missed
    print(f"\nsession tally: predicted == actual for {matched} of {matched + missed} requests")
    own, own_missed = matched - tally_before[0], missed - tally_before[1]
    print(f"this module's: {own} of {own + own_missed}")
    assert own >= 10
