"""Soft state shared by active-active gateways: facts on a bus, and roles one holds.

What one gateway learns that the others should know (a prefix it warmed at a
provider, one that read cold, an anchor and its arrivals, the provider's
rate-limit headroom) is a :class:`Fact`.  Each gateway applies its own facts
to its own structures at once and publishes them; every other gateway applies
them when they arrive, so reads stay local and synchronous (planning never
waits on the network) and the gateways agree within milliseconds.  A *role*
(the provider control loop's heartbeats) is held by one gateway at a time
under a lease that its holder renews; when the holder dies the lease runs
out and another takes it.  A *claim* is a one-off: the first gateway to ask
for a name gets it until its TTL runs out (a cold anchor's writer, for
send-one-then-fan across gateways).

:class:`LocalBus` is the embedded default (one gateway: nothing to share,
every role its own).  :class:`gateway.state.redis_bus.RedisBus` keeps the
facts in a Redis stream (``state.url: redis://...``).  Facts are soft state:
a bus that cannot reach its store keeps serving from what the gateway knows,
reports itself failing (readiness shows it degraded), and once back republishes
a snapshot of what this gateway holds, so a store restarted empty is rebuilt.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Fact:
    kind: str  # "warm", "cold", "anchor", "arrival", "limits"
    origin: str  # the gateway that learnt it (its instance id)
    at: float  # wall clock (time.time()) when it was published
    body: dict[str, Any]

    def elapsed(self, scale: float = 1.0) -> float:
        """Seconds since it was published, on a clock running ``scale`` times faster."""
        return max(0.0, time.time() - self.at) * scale


Handler = Callable[[Fact], None]
Snapshot = Callable[[], list[tuple[str, dict[str, Any]]]]


class StateBus(Protocol):
    origin: str

    def publish(self, kind: str, body: dict[str, Any]) -> None:
        """Queue a fact for the other gateways (never blocks, never raises)."""

    def on(self, kind: str, handler: Handler) -> None:
        """Apply facts of ``kind`` published by other gateways."""

    def snapshot(self, source: Snapshot) -> None:
        """What this gateway holds, as facts: republished after the store came back."""

    def holds(self, role: str) -> bool:
        """Whether this gateway holds ``role`` now."""

    async def claim(self, name: str, ttl_s: float) -> bool:
        """Whether this gateway is the first to claim ``name`` in the next ``ttl_s``
        (True where the store cannot say: each gateway then acts alone)."""

    @property
    def failing_since(self) -> float | None:
        """``time.monotonic()`` of the first failure in a row (None: working)."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class LocalBus:
    """One gateway: its own facts are already applied, every role is its own (of the
    workers of one host without a shared store, worker 0's)."""

    def __init__(self, origin: str = "local", leader: bool = True) -> None:
        self.origin = origin
        self.published = 0
        self._leader = leader  # False: another worker of this host holds the roles

    def publish(self, kind: str, body: dict[str, Any]) -> None:
        self.published += 1

    def on(self, kind: str, handler: Handler) -> None:
        """Nobody else publishes."""

    def snapshot(self, source: Snapshot) -> None:
        """Nothing to rebuild."""

    def holds(self, role: str) -> bool:
        return self._leader

    async def claim(self, name: str, ttl_s: float) -> bool:
        return True  # no other gateway to be first

    @property
    def failing_since(self) -> float | None:
        return None

    async def start(self) -> None:
        """Nothing to connect to."""

    async def close(self) -> None:
        """Nothing to close."""
