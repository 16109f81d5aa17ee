"""Replicas of the local engine and the policies that pick one per request.

``kv`` (default) sends a request to the replica with the longest predicted
cached prefix, unless in-flight load is out of balance by more than
``imbalance`` requests, then to the least loaded.  Ties (a prefix no replica
holds yet) go to the least loaded, then by rendezvous hashing of the
prompt's first block, so a new prefix family lands on one replica and
different families spread.  ``round_robin`` and ``least_loaded`` ignore the
cache; they exist for comparison.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from engines.base import Engine
from manifest.index import LocationId

RoutingPolicy = Literal["kv", "round_robin", "least_loaded"]
POLICIES: tuple[str, ...] = get_args(RoutingPolicy)


@dataclass
class Replica:
    id: LocationId
    engine: Engine
    inflight: int = 0


@dataclass(frozen=True)
class RouteOverride:
    """An admin's choice for one request: a policy, or one replica (load-test oracles)."""

    policy: RoutingPolicy | None = None
    replica: str | None = None


@dataclass(frozen=True)
class LocalReplica:
    """A replica as built (embedded or remote): its engine, when it publishes them its
    KV-event sockets, and how to build a fresh engine when this one dies."""

    id: LocationId
    engine: Engine
    events_endpoint: str | None = None
    replay_endpoint: str | None = None
    factory: Callable[[], Engine] | None = None


class Router:
    def __init__(self, policy: RoutingPolicy = "kv", imbalance: int = 4) -> None:
        self.policy: RoutingPolicy = policy
        self.imbalance = imbalance
        self._next = 0

    def choose(
        self,
        replicas: Sequence[Replica],
        predicted: Mapping[LocationId, int] | None,
        policy: RoutingPolicy | None = None,
        affinity: int = 0,
    ) -> Replica:
        if not replicas:
            raise ValueError("no replicas")
        policy = policy or self.policy
        if policy == "round_robin":
            chosen = replicas[self._next % len(replicas)]
            self._next += 1
            return chosen

        def load_then_affinity(r: Replica) -> tuple[int, int]:
            return (r.inflight, -_rendezvous(affinity, r.id))

        least = min(replicas, key=load_then_affinity)
        if policy == "least_loaded" or not predicted:
            return least
        top = max(predicted.get(r.id, 0) for r in replicas)
        best = min((r for r in replicas if predicted.get(r.id, 0) == top), key=load_then_affinity)
        if best.inflight - least.inflight > self.imbalance:
            return least
        return best


def _rendezvous(affinity: int, replica: str) -> int:
    """Highest-random-weight score of ``replica`` for a key: stable across processes."""
    return zlib.crc32(f"{affinity}:{replica}".encode())
