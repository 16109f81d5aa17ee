"""Exact KV spans on real vLLM CPU replicas: predict, pin, evict, warm, route.

The gateway runs two replicas with small KV caches (128 blocks of 128 tokens
each); tests drive it over HTTP like an operator would.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import httpx
import pytest

from tests.integration.conftest import KEY_A, KEY_B, Gateway, metric, wait_for

pytestmark = pytest.mark.integration

BLOCK = 128


VOCAB = [
    "cache",
    "block",
    "token",
    "model",
    "request",
    "answer",
    "system",
    "prompt",
    "value",
    "server",
    "client",
    "document",
    "question",
    "context",
]


def _words(seed: int, n: int) -> str:
    """Deterministic text of at least ``n`` tokens, different for every seed."""
    return " ".join(random.Random(seed).choices(VOCAB, k=n))


def admin(gateway: Gateway) -> httpx.Client:
    return httpx.Client(
        base_url=gateway.base_url, headers={"Authorization": f"Bearer {KEY_A}"}, timeout=120
    )


def full_blocks(tokens: int) -> int:
    """What vLLM can serve from cache for a prompt: whole blocks, never the last token."""
    return (tokens - 1) // BLOCK * BLOCK


def chat(
    client: httpx.Client,
    model: str,
    messages: list[dict[str, str]],
    routing: str | None = None,
) -> tuple[int, int | None, str, int]:
    """(cached tokens vLLM reported, the gateway's prediction, the replica, prompt tokens)."""
    headers = {"x-vcache-routing": routing} if routing else {}
    r = client.post(
        "/v1/chat/completions",
        json={"model": model, "messages": messages, "max_tokens": 1},
        headers=headers,
    )
    assert r.status_code == 200, r.text
    predicted = r.headers.get("x-vcache-predicted-cached-tokens")
    usage = r.json()["usage"]
    return (
        usage["prompt_tokens_details"]["cached_tokens"],
        None if predicted is None else int(predicted),
        r.headers["x-vcache-replica"],
        usage["prompt_tokens"],
    )


def post(client: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_replicas_agree_with_the_manifest_hashes(gateway: Gateway) -> None:
    with admin(gateway) as c:
        stats = c.get("/v1/cache/stats").json()
    assert set(stats["replicas"]) == {"replica-0", "replica-1"}
    for rep in stats["replicas"].values():
        assert rep["hash_agreement"] == "exact"
        assert rep["engine"]["num_blocks"] == 128


def test_predicted_equals_actual_for_every_request(gateway: Gateway) -> None:
    sys_a = {"role": "system", "content": _words(1, 700)}
    sys_b = {"role": "system", "content": _words(2, 450)}
    convo: list[dict[str, str]] = [sys_a]
    plan: list[list[dict[str, str]]] = []
    for turn in range(5):  # a growing conversation: each turn extends the last
        convo = [*convo, {"role": "user", "content": _words(10 + turn, 90)}]
        plan.append(list(convo))
        convo = [*convo, {"role": "assistant", "content": _words(20 + turn, 60)}]
    for q in range(4):  # siblings sharing one system prompt, then diverging
        plan.append([sys_b, {"role": "user", "content": _words(30 + q, 40 + 60 * q)}])
    plan.append([sys_a, {"role": "user", "content": _words(10, 90)}])  # an exact repeat
    matched = 0
    hits = 0
    with admin(gateway) as c:
        for messages in plan:
            cached, predicted, _, _ = chat(c, gateway.model, messages)
            assert predicted == cached, (predicted, cached)
            matched += 1
            hits += cached > 0
    print(f"\npredicted == actual for {matched}/{len(plan)} requests ({hits} with cache hits)")
    assert hits >= len(plan) - 3  # only each family's first request is cold


def test_a_predicted_request_is_held_until_its_first_token(gateway: Gateway) -> None:
    """The second request of a prefix is routed with its blocks held in the engine
    (``vcache_hold``): its prediction is the engine's count and says ``exact``; the hold
    is released once it has answered."""
    messages = [{"role": "user", "content": _words(45, 600)}]
    with admin(gateway) as c:
        chat(c, gateway.model, messages)
        held = 'vcache_kv_holds_total{outcome="held",replica="%s"}'
        before = {r: metric(gateway.base_url, held % r) for r in ("replica-0", "replica-1")}
        r = c.post(
            "/v1/chat/completions",
            json={"model": gateway.model, "messages": messages, "max_tokens": 1},
        )
        assert r.status_code == 200, r.text
        replica = r.headers["x-vcache-replica"]
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert r.headers["x-vcache-prediction"] == "exact", r.headers
        assert int(r.headers["x-vcache-predicted-cached-tokens"]) == cached > 0
        assert metric(gateway.base_url, held % replica) == before[replica] + 1

        def released() -> bool:
            stats = c.get("/v1/cache/stats").json()["replicas"][replica]["engine"]
            return bool(stats["holds"] == 0 and stats["held_blocks"] == 0)

        wait_for(released, timeout_s=10)


def test_evict_then_the_same_request_is_cold(gateway: Gateway) -> None:
    messages = [{"role": "user", "content": _words(40, 500)}]
    with admin(gateway) as c:
        chat(c, gateway.model, messages)
        cached, predicted, replica, n = chat(c, gateway.model, messages)
        assert cached == predicted == full_blocks(n) > 0
        found = post(c, "/v1/cache/lookup", {"model": gateway.model, "messages": messages})
        held = next(r for r in found["replicas"] if r["replica"] == replica)
        assert held["predicted_cached_tokens"] == cached and all(held["resident"])
        out = post(c, "/v1/cache/evict", {"model": gateway.model, "messages": messages})
        evicted = next(r for r in out["replicas"] if r["replica"] == replica)
        assert len(evicted["evicted"]) == n // BLOCK and evicted["busy"] == []
        cached, predicted, _, _ = chat(c, gateway.model, messages)
        assert cached == predicted == 0


def _flood(c: httpx.Client, model: str, replica: str, seed: int, n: int = 12) -> None:
    """Fill one replica's 128 KV blocks with unrelated prompts (14 blocks each)."""
    for i in range(n):
        ids = [(seed * 1000 + i * 37 + j) % 3900 + 100 for j in range(1850)]
        body = {"model": model, "token_ids": ids, "replica": replica}
        post(c, "/v1/cache/warm", body)


def test_pinned_anchor_survives_pressure_and_goes_after_unpin(gateway: Gateway) -> None:
    model, replica = gateway.model, "replica-0"
    anchor = {"model": model, "prompt": _words(50, 600), "replica": replica}
    control = {"model": model, "prompt": _words(51, 600), "replica": replica}
    with admin(gateway) as c:
        span = post(c, "/v1/cache/warm", anchor)["cached_tokens_after"]
        assert span >= 3 * BLOCK
        assert post(c, "/v1/cache/warm", control)["cached_tokens_after"] >= 3 * BLOCK
        pinned = post(c, "/v1/cache/pin", {**anchor, "lease_s": 600})
        assert len(pinned["replicas"][0]["pinned"]) == span // BLOCK
        _flood(c, model, replica, seed=1)
        a = post(c, "/v1/cache/lookup", anchor)["replicas"][0]
        ctl = post(c, "/v1/cache/lookup", control)["replicas"][0]
        print(
            f"\nunder pressure: pinned anchor {a['predicted_cached_tokens']} cached tokens, "
            f"unpinned control {ctl['predicted_cached_tokens']}"
        )
        assert ctl["predicted_cached_tokens"] == 0  # the control was evicted by the flood
        assert a["predicted_cached_tokens"] == span and all(a["pinned"])
        r = c.post(
            "/v1/completions",
            json={"model": model, "prompt": anchor["prompt"] + " tail", "max_tokens": 1},
        )
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == span
        assert r.headers["x-vcache-replica"] == replica  # kv routing found the pinned span

        unpinned = post(c, "/v1/cache/unpin", anchor)
        assert len(unpinned["replicas"][0]["unpinned"]) == span // BLOCK
        _flood(c, model, replica, seed=2)
        a = post(c, "/v1/cache/lookup", anchor)["replicas"][0]
        assert a["predicted_cached_tokens"] == 0 and not any(a["pinned"])


def test_warm_then_the_first_real_request_hits(gateway: Gateway) -> None:
    prompt = _words(60, 400)
    with admin(gateway) as c:
        warmed = post(c, "/v1/cache/warm", {"model": gateway.model, "prompt": prompt})
        assert warmed["cached_tokens_before"] == 0
        r = c.post(
            "/v1/completions", json={"model": gateway.model, "prompt": prompt, "max_tokens": 1}
        )
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == warmed["cached_tokens_after"] == 3 * BLOCK
        assert r.headers["x-vcache-replica"] == warmed["replica"]


def test_tenants_do_not_share_spans(gateway: Gateway) -> None:
    messages = [{"role": "user", "content": _words(70, 400)}]
    with (
        admin(gateway) as a,
        httpx.Client(
            base_url=gateway.base_url, headers={"Authorization": f"Bearer {KEY_B}"}, timeout=60
        ) as b,
    ):
        chat(a, gateway.model, messages)
        cached, _, _, n = chat(a, gateway.model, messages)
        assert cached == full_blocks(n) > 0
        cached, predicted, _, _ = chat(b, gateway.model, messages)
        assert cached == predicted == 0
        assert b.get("/v1/cache/stats").status_code == 403  # the cache API is admin-only


def _groups_run(
    c: httpx.Client, model: str, policy: str, seed: int
) -> tuple[int, int, Counter[tuple[int, str]]]:
    """3 groups x 4 questions sharing a group prefix; returns (cached, prompt tokens, placement).

    Three groups over two replicas: round robin sends each group to both.
    """
    cached_total = prompt_total = 0
    placement: Counter[tuple[int, str]] = Counter()
    for q in range(4):
        for g in range(3):
            messages = [
                {"role": "system", "content": _words(seed + g, 520)},
                {"role": "user", "content": _words(seed + 100 + q * 10 + g, 30)},
            ]
            r = c.post(
                "/v1/chat/completions",
                json={"model": model, "messages": messages, "max_tokens": 1},
                headers={"x-vcache-routing": policy},
            )
            assert r.status_code == 200
            usage = r.json()["usage"]
            cached_total += usage["prompt_tokens_details"]["cached_tokens"]
            prompt_total += usage["prompt_tokens"]
            placement[(g, r.headers["x-vcache-replica"])] += 1
    return cached_total, prompt_total, placement


def test_kv_routing_keeps_groups_on_the_replica_that_holds_them(gateway: Gateway) -> None:
    with admin(gateway) as c:
        kv_cached, kv_prompt, kv_place = _groups_run(c, gateway.model, "kv", seed=300)
        rr_cached, rr_prompt, rr_place = _groups_run(c, gateway.model, "round_robin", seed=400)
    kv_rate, rr_rate = kv_cached / kv_prompt, rr_cached / rr_prompt
    print(
        f"\nrouting kv: hit rate {kv_rate:.3f} ({kv_cached}/{kv_prompt} tokens); "
        f"round_robin: {rr_rate:.3f} ({rr_cached}/{rr_prompt})"
    )
    # under kv every group stays on one replica; under round_robin groups are split
    assert all(sum(1 for (g2, _) in kv_place if g2 == g) == 1 for g in range(3))
    assert all(sum(1 for (g2, _) in rr_place if g2 == g) == 2 for g in range(3))
    assert kv_rate > rr_rate
