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
(``imbalance``: then the least loaded).  A new agent session's turn (its
KV will be leased across its tool-call pauses) weighs the replicas' pin
budgets too: where the chosen replica's budget has less room than the
session is expected to lease, another with more room takes it when the
lease it keeps outweighs the cached prefix it gives up (``lease_room``).  A
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
    # a new session's turn: the tokens its lease is expected to hold, and each replica's
    # pin budget left, in tokens (None: no lease follows, or no budget known)
    lease_tokens: int = 0
    lease_room: Mapping[LocationId, int] | None = None


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


def _roomier(replicas: Sequence[Replica], chosen: Replica, ctx: RouteContext) -> Replica | None:
    """For a new session's turn: a replica whose pin budget keeps more of the session's
    expected lease than ``chosen``'s, by more than the cached prefix it gives up (both in
    tokens: a refused lease's blocks are prefilled again after the pause, the prefix now);
    None when ``chosen`` has room, or nothing gains."""
    room, need = ctx.lease_room, ctx.lease_tokens
    if room is None or need <= 0:
        return None
    predicted = ctx.predicted or {}

    def gain(r: Replica) -> int:
        kept = min(need, max(room.get(r.id, 0), 0)) - min(need, max(room.get(chosen.id, 0), 0))
        return kept - (predicted.get(chosen.id, 0) - predicted.get(r.id, 0))

    best = max(replicas, key=lambda r: (gain(r), -r.inflight))
    return best if gain(best) > 0 else None


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
            d = Decision(least, "no_index")
        elif top == 0:
            d = Decision(least, "cold")
        else:
            best = _least_loaded(
                [r for r in replicas if predicted.get(r.id, 0) == top], ctx.affinity
            )
            if best.inflight - least.inflight > self.imbalance:
                return Decision(least, "imbalance")
            d = Decision(best, "longest_prefix")
        roomier = _roomier(replicas, d.replica, ctx)
        if roomier is not None and roomier.inflight - least.inflight <= self.imbalance:
            return Decision(roomier, "lease_room")
        return d


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
