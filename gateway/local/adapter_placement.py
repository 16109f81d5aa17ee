"""Where a request under a LoRA adapter may run: the adapter's residency weighed against
the cache hit each replica gives (pure: values in, the replicas out).

Each serving replica is an :class:`Option`: the tokens of the prompt it holds under
the adapter (its blocks are keyed by the adapter, so only where it ran, and where
they outlived an unload), whether it holds the adapter (or is loading it now), and
whether it can load it (a free slot, or an adapter it may let go: none leased).  A
replica costs the prefill of what it does not hold, plus the adapter's load where
it must load it (:class:`LoadCost`: measured at its last load, in seconds, turned
into prompt tokens at the prefill rate).  :func:`place` keeps the replicas that
hold the adapter, and one that must load it only when the cache hit it offers
outweighs the load (blocks left from before an unload); with none holding it, one
replica (the adapter's name decides among equals, so concurrent first requests
agree), and a replica loading it now holds it: one load for them all.  The router
then chooses among those kept as for any request (longest prefix, load).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from manifest.index import LocationId

DEFAULT_LOAD_S = 1.0  # an adapter never loaded yet: what a load is taken to cost


@dataclass(frozen=True)
class LoadCost:
    """What loading one adapter cost, measured: its weights' bytes and the seconds the
    engine took."""

    bytes: int
    seconds: float


@dataclass(frozen=True)
class Option:
    replica: LocationId
    cached: int  # prompt tokens it holds under the adapter
    holds: bool  # holds the adapter, or a load of it there is under way
    loadable: bool  # can load it: a free slot, or an unleased adapter to let go
    free: bool = True  # loading it there lets no other adapter go


def load_tokens(cost: LoadCost | None, prefill_s_per_token: float) -> int:
    """A load's cost in prompt tokens: the prefill the same seconds would buy."""
    seconds = DEFAULT_LOAD_S if cost is None else cost.seconds
    return int(seconds / prefill_s_per_token) if prefill_s_per_token > 0 else 0


def _rendezvous(key: str, replica: LocationId) -> int:
    return zlib.crc32(f"{key}:{replica}".encode())


def place(
    options: Iterable[Option], prompt_tokens: int, load: int, key: str = ""
) -> set[LocationId]:
    """The replicas a request under the adapter may go to (``load``: the adapter's load
    in prompt tokens, :func:`load_tokens`): every replica that holds it, and those that
    must load it but cost less than the cheapest of them (their cache hit outweighs the
    load); with none holding it, the one that can load it at least cost, ties broken by
    rendezvous hashing of ``key`` (the adapter's name), so concurrent first requests
    for an adapter all go to one replica and load it once.  A replica with a free
    slot goes before one that must let another adapter go; one that neither holds it
    nor can load it is never kept.  Empty when none qualifies (the caller lets the
    router choose among all)."""
    opts = list(options)
    holders = {o.replica: max(prompt_tokens - o.cached, 0) for o in opts if o.holds}
    can = [o for o in opts if o.loadable and not o.holds]
    if any(o.free for o in can):  # a load that lets another adapter go comes last
        can = [o for o in can if o.free]
    loaders = {o.replica: max(prompt_tokens - o.cached, 0) + load for o in can}
    if not holders:
        if not loaders:
            return set()
        least = min(loaders.values())
        ties = [r for r, c in loaders.items() if c == least]
        return {max(ties, key=lambda r: _rendezvous(key, r))}
    least = min(holders.values())
    return set(holders) | {r for r, c in loaders.items() if c < least}
