"""Routing policies, narrated."""

from __future__ import annotations

from collections import Counter

import pytest

from engines.fake import FakeEngine
from gateway.local.replicas import Replica, Router
from manifest.index import LocationId

R0, R1, R2 = LocationId("replica-0"), LocationId("replica-1"), LocationId("replica-2")


def replicas(*loads: int) -> list[Replica]:
    engine: FakeEngine = object.__new__(FakeEngine)  # never called by the router
    return [Replica(LocationId(f"replica-{i}"), engine, inflight=n) for i, n in enumerate(loads)]


def test_kv_prefers_the_longest_cached_prefix() -> None:
    rs = replicas(0, 0, 0)
    assert Router("kv").choose(rs, {R0: 0, R1: 512, R2: 256}).id == R1


def test_kv_falls_back_to_least_loaded_when_out_of_balance() -> None:
    rs = replicas(0, 6, 1)
    router = Router("kv", imbalance=4)
    assert router.choose(rs, {R0: 0, R1: 512, R2: 0}).id == R0
    rs[1].inflight = 4
    assert router.choose(rs, {R0: 0, R1: 512, R2: 0}).id == R1  # within tolerance


def test_new_prefix_families_spread_and_stick() -> None:
    rs = replicas(0, 0, 0)
    router = Router("kv")
    cold = {R0: 0, R1: 0, R2: 0}
    placed = [router.choose(rs, cold, affinity=key).id for key in range(300)]
    counts = Counter(placed)
    assert set(counts) == {R0, R1, R2} and min(counts.values()) > 60  # spread
    assert [router.choose(rs, cold, affinity=key).id for key in range(300)] == placed  # stable


def test_ties_prefer_the_less_loaded_replica() -> None:
    rs = replicas(2, 0, 2)
    assert Router("kv").choose(rs, {R0: 256, R1: 256, R2: 256}, affinity=7).id == R1


def test_round_robin_and_least_loaded_ignore_the_cache() -> None:
    rs = replicas(3, 1, 2)
    rr = Router("round_robin")
    assert [rr.choose(rs, {R0: 999}).id for _ in range(4)] == [R0, R1, R2, R0]
    assert Router("least_loaded").choose(rs, {R0: 999}).id == R1
    assert Router("kv").choose(rs, {R0: 999}, policy="least_loaded").id == R1


def test_no_replicas_is_an_error() -> None:
    with pytest.raises(ValueError):
        Router().choose([], None)
