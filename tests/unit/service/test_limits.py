"""Per-key limits (requests and tokens per minute, requests at once) with a fake clock,
the priority a request is served at, and admission's shedding order by priority."""

from __future__ import annotations

import contextlib

import pytest

from gateway.core.config import ApiKeyConfig, EngineSettings, KeyLimits, hash_api_key
from gateway.core.errors import InvalidRequest, RateLimited, Unavailable
from gateway.core.metrics import Metrics
from gateway.core.types import Principal
from gateway.local.dispatch import Dispatcher
from gateway.local.routing import Router
from gateway.service.auth import KeyRing
from gateway.service.limits import RateLimits, anthropic_headers
from tests.unit.builders import booted


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _who(**limits: int) -> Principal:
    return Principal(tenant="t", key_name="k", limits=KeyLimits(**limits))


def test_requests_per_minute_slide_and_say_when_to_retry() -> None:
    clock = Clock()
    rl = RateLimits(clock)
    who = _who(requests_per_minute=2)
    for _ in range(2):
        g = rl.admit(who)
        assert g is not None
        g.done(10)
        clock.t += 10
    with pytest.raises(RateLimited) as err:
        rl.admit(who)
    e = err.value
    assert (e.status, e.code) == (429, "rate_limit_exceeded")
    h = e.headers()
    assert h["x-ratelimit-limit-requests"] == "2" and h["x-ratelimit-remaining-requests"] == "0"
    assert h["Retry-After"] == "40"  # the first request leaves the window 40 s from now
    assert h["x-ratelimit-reset-requests"] == "40s"
    clock.t += 40
    assert rl.admit(who) is not None  # one slot freed by the window sliding


def test_tokens_per_minute_count_when_the_answer_ends() -> None:
    clock = Clock()
    rl = RateLimits(clock)
    who = _who(tokens_per_minute=100)
    a, b = rl.admit(who), rl.admit(who)  # both admitted: nothing used yet
    assert a is not None and b is not None
    a.done(60)
    b.done(50)
    b.done(50)  # a second done counts nothing
    with pytest.raises(RateLimited) as err:
        rl.admit(who)
    assert err.value.headers()["x-ratelimit-remaining-tokens"] == "0"
    clock.t += 60
    g = rl.admit(who)
    assert g is not None and g.headers()["x-ratelimit-remaining-tokens"] == "100"


def test_concurrent_requests_free_their_slot() -> None:
    rl = RateLimits(Clock())
    who = _who(max_concurrent=1)
    g = rl.admit(who)
    assert g is not None
    with pytest.raises(RateLimited):
        rl.admit(who)
    g.done(0)
    assert rl.admit(who) is not None


def test_a_key_without_limits_is_not_counted() -> None:
    rl = RateLimits(Clock())
    assert rl.admit(Principal(tenant="t")) is None
    assert rl.admit(_who()) is None  # limits given, none set


def test_limits_are_per_key() -> None:
    rl = RateLimits(Clock())
    a = Principal(tenant="t", key_name="a", limits=KeyLimits(max_concurrent=1))
    b = Principal(tenant="t", key_name="b", limits=KeyLimits(max_concurrent=1))
    assert rl.admit(a) is not None and rl.admit(b) is not None
    with pytest.raises(RateLimited):
        rl.admit(a)


def test_anthropic_names_and_reset_times() -> None:
    out = anthropic_headers(
        {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-tokens": "30s", "a": "b"},
        now_epoch=1_800_000_000,
    )
    assert out == {
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-tokens-reset": "2027-01-15T08:00:30Z",
        "a": "b",
    }


def test_priority_header_is_capped_by_the_key() -> None:
    ring = KeyRing(
        [
            ApiKeyConfig(sha256=hash_api_key("sk-1"), name="one"),
            ApiKeyConfig(
                sha256=hash_api_key("sk-2"), name="bulk", priority="batch", max_priority="default"
            ),
        ]
    )
    assert ring.authenticate("Bearer sk-1").priority == "default"
    assert ring.authenticate("Bearer sk-1", "interactive").priority == "interactive"
    assert ring.authenticate("Bearer sk-2").priority == "batch"  # the key's default
    assert ring.authenticate("Bearer sk-2", "interactive").priority == "default"  # capped
    assert ring.authenticate("Bearer sk-2", "batch").priority == "batch"
    with pytest.raises(InvalidRequest) as err:
        ring.authenticate("Bearer sk-1", "urgent")
    assert err.value.param == "x-vcache-priority"
    with pytest.raises(ValueError, match="above max_priority"):
        ApiKeyConfig(sha256=hash_api_key("x"), priority="interactive", max_priority="default")


def test_admission_sheds_batch_first_and_interactive_last() -> None:
    engine = EngineSettings(
        max_queued_requests=10, admission_shares={"batch": 0.5, "default": 0.8, "interactive": 1.0}
    )
    assert EngineSettings(max_queued_requests=256).admission_room() == {
        "interactive": 282,
        "default": 256,
        "batch": 128,
    }
    metrics = Metrics()
    d = Dispatcher(booted([]), Router(), metrics, max_inflight=10, room=engine.admission_room())

    def room(priority: str) -> int:
        """How many requests in flight a request of ``priority`` is still admitted beside."""
        with contextlib.ExitStack() as held:
            n = 0
            while True:
                try:
                    held.enter_context(d.admit(priority))  # type: ignore[arg-type]
                except Unavailable as exc:
                    assert exc.code == "queue_full" and exc.retry_after_s
                    return n
                n += 1

    assert (room("batch"), room("default"), room("interactive")) == (5, 8, 10)
    with d.admit("default"), d.admit("default"), d.admit("default"), d.admit("default"):
        with d.admit("default"), pytest.raises(Unavailable), d.admit("batch"):
            pass
        with d.admit("interactive"):  # beside five default requests, interactive still fits
            pass
    shed = metrics.shed.labels("batch")._value.get()
    assert shed >= 2
