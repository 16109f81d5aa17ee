"""A paused session's conversation tip on a hosted provider: what keeps it warm across
the pause (design note §5.4, applied to one session's gaps instead of an anchor's
arrival rate).

A *tip* is the prefix one turn of an agent session wrote at the provider (its whole
prompt, through the last breakpoint).  The session's next turn reads it if it comes
back within the TTL.  The gap ``g`` is predicted from the session's own gaps (the
tenant's before it has any): a high quantile times a margin, as the local replicas'
lease across a tool-call pause is.  Costs in token-equivalents per tip token, the
uncached input price being 1, ``r`` the read price, ``W`` a tier's write price,
``L`` the latency value of a warm first token and ``μ`` the rate-limit shadow price
of one more request:

- ``g < T`` (the short TTL): the next turn finds it warm (**ride**);
- **lazy**: the next turn writes it again, ``W - r`` more than a read, and waits
  for a cold first token, ``+ L``;
- **heartbeat**: reads at ``h·T`` intervals (``h``: the heartbeat point, a share of
  the TTL) keep it warm through ``g``: ``ceil((g - T) / (h·T))`` of them, ``r + μ``
  each;
- **long**: the turn writes it at the long tier (Anthropic's 1 hour) instead,
  ``W_long - W_short`` more, where ``g`` is inside the long TTL.

The cheapest is taken; on a tie the one that sends less (lazy, then long, then
heartbeat).
"""

from __future__ import annotations

import math
from collections import deque
from enum import StrEnum

from manifest.governor import Economics

MAX_GAPS = 64  # per session and per tenant, the most recent


class Gaps:
    """The most recent gaps (seconds between a turn's end and the next turn's start)."""

    def __init__(self) -> None:
        self._gaps: deque[float] = deque(maxlen=MAX_GAPS)

    def __len__(self) -> int:
        return len(self._gaps)

    def add(self, gap_s: float) -> None:
        self._gaps.append(gap_s)

    def quantile(self, q: float) -> float | None:
        if not self._gaps:
            return None
        ordered = sorted(self._gaps)
        return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def expected_gap(own: Gaps | None, tenant: Gaps | None, quantile: float, default_s: float) -> float:
    """The pause expected after a session's turn: the ``quantile`` of its own gaps, else
    of its tenant's, else ``default_s`` (callers apply their margin and bounds)."""
    q = own.quantile(quantile) if own is not None else None
    if q is None and tenant is not None:
        q = tenant.quantile(quantile)
    return default_s if q is None else q


class TipPlan(StrEnum):
    RIDE = "ride"
    LAZY = "lazy"
    HEARTBEAT = "heartbeat"
    LONG = "long"


def heartbeats_needed(gap_s: float, ttl_s: float, heartbeat_at: float) -> int:
    """Reads at ``heartbeat_at·T`` intervals from the turn's end that keep the tip warm
    until ``gap_s`` (each refreshes the TTL)."""
    if gap_s < ttl_s:
        return 0
    return math.ceil((gap_s - ttl_s) / (heartbeat_at * ttl_s)) or 1


def tip_costs(
    gap_s: float, econ: Economics, heartbeat_at: float, shadow: float = 0.0
) -> dict[TipPlan, float]:
    """The extra cost per tip token of each way through a pause of ``gap_s`` (above a
    warm read); ride alone where the next turn comes back within the short TTL."""
    short = min(econ.options, key=lambda o: o.ttl_s)
    if gap_s < short.ttl_s:
        return {TipPlan.RIDE: 0.0}
    r = econ.read_mult
    write = short.write_mult if econ.writes_billed else 1.0
    costs = {TipPlan.LAZY: write - r + econ.latency_value}
    longest = max(econ.options, key=lambda o: o.ttl_s)
    if longest.ttl_s > short.ttl_s and gap_s < longest.ttl_s:
        costs[TipPlan.LONG] = longest.write_mult - short.write_mult
    n = heartbeats_needed(gap_s, short.ttl_s, heartbeat_at)
    costs[TipPlan.HEARTBEAT] = n * (r + shadow)
    return costs


def tip_plan(gap_s: float, econ: Economics, heartbeat_at: float, shadow: float = 0.0) -> TipPlan:
    """The cheapest way through a pause of ``gap_s`` (ties: the one sending less)."""
    costs = tip_costs(gap_s, econ, heartbeat_at, shadow)
    order = (TipPlan.RIDE, TipPlan.LAZY, TipPlan.LONG, TipPlan.HEARTBEAT)
    return min((p for p in order if p in costs), key=lambda p: costs[p])
