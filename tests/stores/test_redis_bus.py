"""The state bus on a real Redis server: facts reach the other gateways (and a late
one catches up), a role has one holder and passes on when it goes, and a Redis that
cannot be reached leaves the gateway serving and republishing once it is back.  (A
Redis nobody listens for, and the in-process bus: tests/unit/state/test_bus.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gateway.state.bus import Fact
from gateway.state.redis_bus import RedisBus
from tests.stores.servers import ThrowawayRedis, until

pytestmark = pytest.mark.stores


def _run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())  # type: ignore[arg-type]


def test_facts_reach_the_other_gateways_and_a_late_one_catches_up(
    redis_prefix: tuple[str, str],
) -> None:
    url, prefix = redis_prefix

    async def main() -> None:
        a, b = RedisBus(url, "gw-a", prefix), RedisBus(url, "gw-b", prefix)
        seen: dict[str, list[Fact]] = {"a": [], "b": [], "c": []}
        a.on("warm", seen["a"].append)
        b.on("warm", seen["b"].append)
        await a.start()
        await b.start()
        a.publish("warm", {"digest": "d1"})
        a.publish("cold", {"digest": "d0"})  # nobody listens for cold here
        await until(lambda: len(seen["b"]) == 1)
        fact = seen["b"][0]
        assert (fact.kind, fact.origin, fact.body) == ("warm", "gw-a", {"digest": "d1"})
        assert 0 <= fact.elapsed() < 5
        assert seen["a"] == []  # its own facts are not applied twice
        c = RedisBus(url, "gw-c", prefix)
        c.on("warm", seen["c"].append)
        await c.start()  # read what was published before it came
        assert [f.body for f in seen["c"]] == [{"digest": "d1"}]
        for bus in (a, b, c):
            await bus.close()

    _run(main)


def test_a_role_has_one_holder_and_passes_on_when_it_goes(
    redis_prefix: tuple[str, str],
) -> None:
    url, prefix = redis_prefix

    async def main() -> None:
        a = RedisBus(url, "gw-a", prefix, role_ttl_s=0.6)
        b = RedisBus(url, "gw-b", prefix, role_ttl_s=0.6)
        await a.start()
        await b.start()
        await until(lambda: a.holds("lead") or b.holds("lead"))
        await asyncio.sleep(0.5)  # both asked, several renewals
        assert [a.holds("lead"), b.holds("lead")].count(True) == 1
        holder, other = (a, b) if a.holds("lead") else (b, a)
        await holder.close()  # gone: the other takes it
        await until(lambda: other.holds("lead"), timeout_s=3)
        await other.close()

    _run(main)


def test_a_redis_restarted_empty_is_rebuilt_from_the_gateways(
    throwaway_redis: ThrowawayRedis,
) -> None:
    """Redis killed under a gateway: it keeps serving (publishes queue, no role is
    held), says since when it fails; Redis back empty: the queued facts go out and the
    gateway republishes what it holds, so a gateway that starts then learns it."""
    server = throwaway_redis

    async def main() -> None:
        bus = RedisBus(server.url, "gw-a", "t:", role_ttl_s=0.6)
        bus.snapshot(lambda: [("warm", {"digest": "held"})])
        await bus.start()
        await until(lambda: bus.holds("lead"))
        server.stop()
        bus.publish("warm", {"digest": "queued"})
        await until(lambda: bus.failing_since is not None)
        assert not bus.holds("lead")  # a lease it cannot renew is not held
        server.start()  # empty: nothing was kept
        await until(lambda: bus.failing_since is None, timeout_s=15)
        late = RedisBus(server.url, "gw-b", "t:")
        got: list[Any] = []
        late.on("warm", lambda f: got.append(f.body["digest"]))
        await until(lambda: bus.sent >= 2)  # the queued fact and the snapshot
        await late.start()
        # each at least once (a fact applied twice changes nothing: the newer replaces)
        assert set(got) == {"held", "queued"}
        await until(lambda: bus.holds("lead"))
        await bus.close()
        await late.close()

    _run(main)
