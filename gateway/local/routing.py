"""Routing policies: which serving replica gets a request.

One :class:`RoutingPolicy` protocol and a registry of them by name; the
:class:`Router` applies the configured one (or an admin's per-request choice)
and counts every decision by ``{policy, reason}``
(``vcache_routing_decisions_total``).

``kv`` (default) sends a session's next turn back to the replica that
served its last one while that replica holds as long a cached prefix as any
and is not out of balance (``session``); otherwise a request goes to the
replica with the longest predicted cached prefix (``longest_prefix``), unless
in-flight load is out of balance by more than ``imbalance`` requests
(``imbalance``: then the least loaded).  A
prefix no replica holds (``cold``) or a gateway without KV events
(``no_index``) goes to the least loaded, ties broken by rendezvous hashing of
the prompt's first tokens, so a new prefix family lands on one replica and
different families spread.  ``least_loaded`` and ``round_robin`` ignore the
cache; they exist for comparison.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.local.replicas import Replica
from manifest.index import LocationId


@dataclass(frozen=True)
class RouteContext:
    """What a policy knows of one request."""

    predicted: Mapping[LocationId, int] | None  # cached tokens per replica; None: no KV index
    affinity: int = 0  # a hash of the prompt's first tokens
    session: LocationId | None = None  # the replica that served the session's last turn


@dataclass(frozen=True)
class Decision:
    replica: Replica
    reason: str


class RoutingPolicy(Protocol):
    name: str

    def choose(self, replicas: Sequence[Replica], ctx: RouteContext) -> Decision: ...


def _rendezvous(affinity: int, replica: str) -> int:
    """Highest-random-weight score of ``replica`` for a key: stable across processes."""
    return zlib.crc32(f"{affinity}:{replica}".encode())


def _least_loaded(replicas: Sequence[Replica], affinity: int) -> Replica:
    return min(replicas, key=lambda r: (r.inflight, -_rendezvous(affinity, r.id)))


class KvAware:
    name = "kv"

    def __init__(self, imbalance: int = 4) -> None:
        self.imbalance = imbalance

    def choose(self, replicas: Sequence[Replica], ctx: RouteContext) -> Decision:
        least = _least_loaded(replicas, ctx.affinity)
        predicted = ctx.predicted or {}
        top = max(predicted.get(r.id, 0) for r in replicas)
        home = next((r for r in replicas if r.id == ctx.session), None)
        if (
            home is not None
            and predicted.get(home.id, 0) == top
            and home.inflight - least.inflight <= self.imbalance
        ):
            return Decision(home, "session")  # it holds the session's spans, as much as any
        if not ctx.predicted:
            return Decision(least, "no_index")
        if top == 0:
            return Decision(least, "cold")
        best = _least_loaded([r for r in replicas if predicted.get(r.id, 0) == top], ctx.affinity)
        if best.inflight - least.inflight > self.imbalance:
            return Decision(least, "imbalance")
        return Decision(best, "longest_prefix")


class LeastLoaded:
    name = "least_loaded"

    def choose(self, replicas: Sequence[Replica], ctx: RouteContext) -> Decision:
        return Decision(_least_loaded(replicas, ctx.affinity), "least_loaded")


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, replicas: Sequence[Replica], ctx: RouteContext) -> Decision:
        chosen = replicas[self._next % len(replicas)]
        self._next += 1
        return Decision(chosen, "round_robin")


POLICIES: dict[str, Callable[[int], RoutingPolicy]] = {
    "kv": KvAware,
    "least_loaded": lambda _: LeastLoaded(),
    "round_robin": lambda _: RoundRobin(),
}


class Router:
    """The configured policy and the others by name (per-request overrides), each
    decision counted through ``count(policy, reason)``."""

    def __init__(
        self,
        policy: str = "kv",
        imbalance: int = 4,
        count: Callable[[str, str], None] | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; one of {', '.join(POLICIES)}")
        self.policy = policy
        self._policies = {name: make(imbalance) for name, make in POLICIES.items()}
        self._count = count

    def choose(
        self, replicas: Sequence[Replica], ctx: RouteContext, policy: str | None = None
    ) -> Replica:
        if not replicas:
            raise ValueError("no replicas")
        p = self._policies[policy or self.policy]
        d = p.choose(replicas, ctx)
        if self._count is not None:
            self._count(p.name, d.reason)
        return d.replica
