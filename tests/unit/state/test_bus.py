"""The state bus without a Redis server: a Redis nobody listens for leaves the gateway
serving, and the in-process bus holds every role.  (On a real Redis: the stores tier,
tests/stores/test_redis_bus.py.)"""

from __future__ import annotations

import asyncio

from gateway.state.bus import LocalBus
from gateway.state.redis_bus import RedisBus
from tests.loopback import free_port
from tests.unit.waits import until


def test_a_gateway_starts_with_redis_unreachable_and_serves() -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"  # a port nothing listens on

    async def main() -> None:
        bus = RedisBus(dead, "gw-a", "t:")
        await bus.start()  # does not raise
        bus.publish("warm", {"digest": "d"})
        await until(lambda: bus.failing_since is not None)
        await bus.close()

    asyncio.run(main())


def test_the_local_bus_holds_every_role_and_shares_nothing() -> None:
    bus = LocalBus("gw")
    bus.publish("warm", {})
    assert bus.holds("provider-control") and bus.failing_since is None
    assert bus.published == 1
