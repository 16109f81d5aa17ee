"""Two gateways in front of one provider (the emulator), sharing state through a real
Redis: a warm written through one is believed, verified and credited once through the
other; both count each other's arrivals; one heartbeats; the headroom either sees is
the other's; a cold anchor's siblings on both are written once."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from engines.tokenizer import ChatTokenizer
from gateway.service.shared_state import CONTROL_ROLE
from gateway.state.redis_bus import RedisBus
from tests.integration.conftest import wait_for
from tests.providers.conftest import KEY, MANUAL, MODELS, Emulator, Gw, make_gateway

pytestmark = pytest.mark.stores  # a real Redis shared by the gateways

ANTHROPIC = f"anthropic/{MODELS['anthropic']}"
OPENAI = f"openai/{MODELS['openai']}"


def _pair(
    emulator: Emulator,
    tokenizer: ChatTokenizer,
    redis_prefix: tuple[str, str],
    control: dict[str, Any],
) -> Iterator[tuple[Gw, Gw]]:
    url, prefix = redis_prefix
    emulator.admin("reset")
    state = {"url": url, "prefix": prefix, "role_ttl_s": 1.0}
    with contextlib.ExitStack() as stack:
        gws = [
            stack.enter_context(
                contextlib.contextmanager(make_gateway)(
                    emulator, tokenizer, state=state, control=control
                )
            )
            for _ in range(2)
        ]
        yield gws[0], gws[1]


HEARTBEAT_ALL = {"mode": "heartbeat_all", "tick_s": 3600, "fan_wait_s": 0}
GOVERNED = {"mode": "govern", "tick_s": 3600, "fan_wait_s": 5}


@pytest.fixture
def pair(
    request: pytest.FixtureRequest,
    emulator: Emulator,
    tokenizer: ChatTokenizer,
    redis_prefix: tuple[str, str],
) -> Iterator[tuple[Gw, Gw]]:
    """Two gateways; their control loop as the test's ``pair`` parameter says."""
    control = getattr(request, "param", HEARTBEAT_ALL)
    yield from _pair(emulator, tokenizer, redis_prefix, control)


def _bus(gw: Gw) -> RedisBus:
    bus = gw.http.app.state.bus  # type: ignore[attr-defined]
    assert isinstance(bus, RedisBus)
    return bus


def _arrivals(gw: Gw) -> int:
    return sum(len(x.arrivals.times) for x in gw.control().anchors.values())


def test_a_warm_written_through_one_gateway_is_believed_and_credited_once_by_the_other(
    pair: tuple[Gw, Gw],
) -> None:
    a, b = pair
    first = a.ask(ANTHROPIC, "what is a block?")
    assert first["prompt_tokens_details"]["cached_tokens"] == 0  # A writes the cache
    wait_for(lambda: len(b.path.book.belief) > 0, timeout_s=10)  # A's warm fact reached B
    second = b.ask(ANTHROPIC, "what is a span?")
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached > 1000
    sa, sb = a.stats()[ANTHROPIC], b.stats()[ANTHROPIC]
    # B planned it warm and verified the hit against the record A published: credited,
    # by B alone (A settled no answer that read it)
    assert sb["false_warm"] == 0 and sb["credited_tokens"] > 1000
    assert sb["unverified_tokens"] == 0
    assert sa["credited_tokens"] == 0 and sa["requests"] == 1


def test_both_count_every_arrival_and_only_one_heartbeats(pair: tuple[Gw, Gw]) -> None:
    a, b = pair
    a.ask(ANTHROPIC, "q1")
    b.ask(ANTHROPIC, "q2")
    a.ask(ANTHROPIC, "q3")
    for gw in (a, b):  # every gateway's anchor counts all three
        wait_for(lambda gw=gw: _arrivals(gw) == 3, timeout_s=10)
    wait_for(lambda: _bus(a).holds(CONTROL_ROLE) or _bus(b).holds(CONTROL_ROLE), timeout_s=10)
    for gw in (a, b):
        gw.clock.now += 250  # 250 s idle of a 5-minute TTL: a heartbeat is due
    a.emulator.admin("clock/advance", seconds=250)
    before = len(a.emulator.received())
    sent = 0
    for gw in (a, b):
        send = gw.http.app.state.service.warm_provider  # type: ignore[attr-defined]
        sent += len(gw.http.portal.call(gw.control().tick, send))  # type: ignore[union-attr]
    assert sent == 1 and len(a.emulator.received()) == before + 1  # one gateway warmed it
    leader, other = (a, b) if _bus(a).holds(CONTROL_ROLE) else (b, a)
    assert leader.control().counts["heartbeats"] == 1
    assert other.control().counts["heartbeats"] == 0
    # the heartbeat refreshed the anchor on the other gateway too
    anchors = other.control().anchors.values()
    wait_for(lambda: all(other.clock.now - x.touched < 1 for x in anchors), timeout_s=10)


def test_the_headroom_one_gateway_saw_is_the_others(pair: tuple[Gw, Gw]) -> None:
    a, b = pair
    a.emulator.admin("limits", provider="openai", rpm=100, tpm=100000)
    b.ask(OPENAI, "q0")  # B knows the target
    a.ask(OPENAI, "q1")
    seen = a.path.target(OPENAI).client.limits
    assert seen is not None and seen.requests_remaining is not None
    send = a.http.app.state.service.warm_provider  # type: ignore[attr-defined]
    a.http.portal.call(a.control().tick, send)  # type: ignore[union-attr]  # shares it
    wait_for(lambda: b.path.target(OPENAI).client.limits == seen, timeout_s=10)


@pytest.mark.parametrize("pair", [GOVERNED], indirect=True)
def test_a_cold_anchors_sibling_on_the_other_gateway_waits_for_the_first(
    pair: tuple[Gw, Gw],
) -> None:
    """Send-one-then-fan across gateways: the first request of a cold anchor (through A,
    stalled a second at the provider) claims it in Redis; its sibling through B waits
    for A's fact that its answer began, then reads what A wrote."""
    a, b = pair
    a.emulator.admin("faults", kind="timeout", provider="anthropic", delay_s=1.0)
    usages: dict[str, Any] = {}

    def ask_a() -> None:
        usages["a"] = a.ask(ANTHROPIC, "question through A")

    first = threading.Thread(target=ask_a)
    first.start()
    # A is the anchor's writer (it claims it in Redis next), then stalls at the provider
    wait_for(lambda: any(x.writer is not None for x in a.control().anchors.values()), 10)
    threading.Event().wait(0.2)
    usages["b"] = b.ask(ANTHROPIC, "question through B")
    first.join()
    assert usages["a"]["prompt_tokens_details"]["cached_tokens"] == 0  # A wrote it
    assert usages["b"]["prompt_tokens_details"]["cached_tokens"] > 1000  # B read it
    assert b.control().counts["held"] == 1 and a.control().counts["held"] == 0
    assert b.stats()[ANTHROPIC]["written_tokens"] < 100  # its own question, not the anchor


def test_a_redis_restarted_under_load_costs_no_request_and_is_rebuilt(
    emulator: Emulator, tokenizer: ChatTokenizer, throwaway_redis: Any
) -> None:
    """Redis killed while a gateway serves provider traffic: every request still
    succeeds (soft state), readiness says degraded; Redis back empty: the gateway's
    belief is republished into it, so a gateway that starts then believes it."""
    import redis

    emulator.admin("reset")
    state = {"url": throwaway_redis.url, "prefix": "rb:", "unavailable_grace_s": 60}
    make = contextlib.contextmanager(make_gateway)
    with make(emulator, tokenizer, state=state) as a:
        statuses = []
        for i in range(5):
            statuses.append(
                a.http.post(
                    "/v1/chat/completions",
                    headers={"authorization": f"Bearer {KEY}"},
                    json={
                        "model": ANTHROPIC,
                        "max_tokens": 4,
                        "messages": [
                            {"role": "system", "content": MANUAL},
                            {"role": "user", "content": f"q{i}"},
                        ],
                    },
                ).status_code
            )
            if i == 1:
                throwaway_redis.stop()
                wait_for(lambda: _bus(a).failing_since is not None, timeout_s=10)
                assert a.http.get("/readyz").json()["stores"]["state"] == "degraded"
        assert statuses == [200] * 5  # no request depended on Redis
        throwaway_redis.start()  # empty
        wait_for(lambda: _bus(a).failing_since is None, timeout_s=15)
        client = redis.Redis.from_url(throwaway_redis.url)
        wait_for(lambda: client.xlen("rb:facts") > 0, timeout_s=10)  # republished
        entries: Any = client.xrange("rb:facts")
        kinds = {json.loads(f[b"f"])["k"] for _, f in entries}
        assert "warm" in kinds
        with make(emulator, tokenizer, state=state) as late:
            wait_for(
                lambda: len(late.path.book.belief) > 0, timeout_s=10
            )  # learnt from the rebuilt store
        assert a.http.get("/readyz").json()["stores"]["state"] == "ok"
