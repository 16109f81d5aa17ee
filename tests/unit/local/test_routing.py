"""Routing policies, narrated; every decision counted by policy and reason."""

from __future__ import annotations

from collections import Counter

import pytest

from engines.fake import FakeEngine
from gateway.local.replicas import Replica
from gateway.local.routing import POLICIES, RouteContext, Router
from manifest.index import LocationId

R0, R1, R2 = LocationId("replica-0"), LocationId("replica-1"), LocationId("replica-2")


def replicas(*loads: int) -> list[Replica]:
    engine: FakeEngine = object.__new__(FakeEngine)  # never called by the router
    return [Replica(LocationId(f"replica-{i}"), engine, inflight=n) for i, n in enumerate(loads)]


def test_kv_prefers_the_longest_cached_prefix() -> None:
    rs = replicas(0, 0, 0)
    assert Router("kv").choose(rs, RouteContext({R0: 0, R1: 512, R2: 256})).id == R1


def test_kv_falls_back_to_least_loaded_when_out_of_balance() -> None:
    rs = replicas(0, 6, 1)
    router = Router("kv", imbalance=4)
    assert router.choose(rs, RouteContext({R0: 0, R1: 512, R2: 0})).id == R0
    rs[1].inflight = 4
    assert router.choose(rs, RouteContext({R0: 0, R1: 512, R2: 0})).id == R1  # within tolerance


def test_new_prefix_families_spread_and_stick() -> None:
    rs = replicas(0, 0, 0)
    router = Router("kv")
    cold = {R0: 0, R1: 0, R2: 0}
    placed = [router.choose(rs, RouteContext(cold, key)).id for key in range(300)]
    counts = Counter(placed)
    assert set(counts) == {R0, R1, R2} and min(counts.values()) > 60  # spread
    assert [router.choose(rs, RouteContext(cold, key)).id for key in range(300)] == placed  # stable


def test_ties_prefer_the_less_loaded_replica() -> None:
    rs = replicas(2, 0, 2)
    assert Router("kv").choose(rs, RouteContext({R0: 256, R1: 256, R2: 256}, 7)).id == R1


def test_round_robin_and_least_loaded_ignore_the_cache() -> None:
    rs = replicas(3, 1, 2)
    rr = Router("round_robin")
    assert [rr.choose(rs, RouteContext({R0: 999})).id for _ in range(4)] == [R0, R1, R2, R0]
    assert Router("least_loaded").choose(rs, RouteContext({R0: 999})).id == R1
    assert Router("kv").choose(rs, RouteContext({R0: 999}), "least_loaded").id == R1


def test_no_replicas_is_an_error() -> None:
    with pytest.raises(ValueError):
        Router().choose([], RouteContext(None))


def test_each_decision_is_counted_by_policy_and_reason() -> None:
    seen: Counter[tuple[str, str]] = Counter()
    router = Router("kv", imbalance=1, count=lambda p, r: seen.update([(p, r)]))
    rs = replicas(0, 0)
    router.choose(rs, RouteContext({R0: 0, R1: 256}))
    router.choose(rs, RouteContext({R0: 0, R1: 0}))
    router.choose(rs, RouteContext(None))
    rs[1].inflight = 3
    router.choose(rs, RouteContext({R0: 0, R1: 256}))
    router.choose(rs, RouteContext(None), "round_robin")
    assert seen == Counter(
        {
            ("kv", "longest_prefix"): 1,
            ("kv", "cold"): 1,
            ("kv", "no_index"): 1,
            ("kv", "imbalance"): 1,
            ("round_robin", "round_robin"): 1,
        }
    )


def test_an_unknown_policy_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="one of"):
        Router("fastest")
    assert set(POLICIES) == {"kv", "least_loaded", "round_robin"}
