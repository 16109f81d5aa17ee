"""A key's per-minute limits hold across active-active gateways sharing a real Redis:
what one admitted counts at the other; concurrency stays each gateway's own."""

from __future__ import annotations

import asyncio

import pytest

from gateway.core.config import KeyLimits
from gateway.core.errors import RateLimited
from gateway.core.types import Principal
from gateway.service.limits import RateLimits
from gateway.service.shared_state import share_key_limits
from gateway.state.redis_bus import RedisBus
from tests.stores.servers import until

pytestmark = pytest.mark.stores


def _who(limits: KeyLimits) -> Principal:
    return Principal(tenant="t", key_name="ci", limits=limits)


def test_requests_and_tokens_per_minute_hold_across_two_gateways(
    redis_prefix: tuple[str, str],
) -> None:
    url, prefix = redis_prefix

    async def main() -> None:
        buses = [RedisBus(url, f"gw-{i}", prefix) for i in range(2)]
        limiters = [RateLimits(publish=bus.publish) for bus in buses]
        for bus, lim in zip(buses, limiters, strict=True):
            share_key_limits(bus, lim)
            await bus.start()
        try:
            await check(limiters[0], limiters[1], buses)
        finally:
            for bus in buses:
                await bus.close()

    async def check(a: RateLimits, b: RateLimits, buses: list[RedisBus]) -> None:
        who = _who(KeyLimits(requests_per_minute=10, max_concurrent=2))
        for _ in range(6):
            grant = a.admit(who)
            assert grant is not None
            grant.done(0)
        await until(lambda: buses[1].applied >= 6)
        for _ in range(4):
            grant = b.admit(who)
            assert grant is not None
            grant.done(0)
        with pytest.raises(RateLimited) as err:  # 6 through A and 4 through B: 10
            b.admit(who)
        assert err.value.headers()["x-ratelimit-remaining-requests"] == "0"
        await until(lambda: buses[0].applied >= 4)
        with pytest.raises(RateLimited):
            a.admit(who)

        t = Principal(tenant="t", key_name="tok", limits=KeyLimits(tokens_per_minute=1000))
        grant = a.admit(t)
        assert grant is not None
        grant.done(1200)  # an answer through A used the minute's tokens
        await until(lambda: buses[1].applied >= 7)  # 6 requests and these tokens
        with pytest.raises(RateLimited, match="tokens per minute"):
            b.admit(t)

        # concurrency is each gateway's own: two in flight on A leave B its two
        c = Principal(tenant="t", key_name="conc", limits=KeyLimits(max_concurrent=2))
        held = [a.admit(c), a.admit(c)]
        with pytest.raises(RateLimited, match="concurrent"):
            a.admit(c)
        assert b.admit(c) is not None and all(g is not None for g in held)

    asyncio.run(main())
